"""Collectives across ranks: read the per-rank ledgers, name the first divergent call, diagnose hangs.

The ledgers are JSON-lines files the ranks append to (``workbench.rank.ledger``); this
module reads them from disk, so it works while a rank is blocked and on saved data.
One row per call: ``rank, session, attempt, step, group, seq, op, dtypes, shapes, numel,
bytes, src, dst (global ranks, as the user's code names them; ``group_src``/``group_dst``: c10d's
group-local value), via, bucket, bucket_tensors, state, error, caller, user_frame, library_frame,
send, recv, t_start, t_end``. ``state`` is ``started`` (still inside), ``completed``, ``failed``,
``timed out`` or ``issued`` (dispatched; the backend gave no completion signal). ``send`` and
``recv`` say what travels to and from each peer (``workbench.rank.traffic``).

Alignment: the n-th call of every rank on a process group (``seq``) should be the same
collective moving the same dtype and element count between each pair of ranks (send and
recv pair per directed channel). The first position where they differ is the first
divergence; everything after it is a consequence.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from workbench.errors import LOST, RankFailure
from workbench.rank.ledger_read import (  # the pairing rule and the reader the job's own watcher shares
    OPEN,
    ROOTED,
    LedgerReader,
    _nz,
    mismatch_kind,
)

LEDGER_COLUMNS = [
    "rank", "session", "attempt", "step", "group", "group_ranks", "seq", "op", "dtypes", "shapes", "numel",
    "bytes", "src", "dst", "via", "bucket", "bucket_tensors", "state", "error", "caller", "user_frame",
    "t_start", "t_end", "c10d_op", "library_frame", "send", "recv", "label", "group_src", "group_dst",
]


# -- reading ----------------------------------------------------------------------------
def read_ledger(source: str | list[str]) -> pd.DataFrame:
    """Every call in a ledger directory (or list of files), one row each, start and end merged."""
    reader = LedgerReader(source)
    reader.poll()
    return ledger_table(reader.calls())


_INT_LEDGER = ("rank", "attempt", "seq", "numel", "bytes", "src", "dst", "bucket", "bucket_tensors", "group_src",
               "group_dst")


def _json_or_none(v: Any) -> Any:
    return v if v is None or isinstance(v, str) else json.dumps(v)


def ledger_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows (from files or written by hand) as the ledger table: flat, Parquet-safe columns."""
    cols: dict[str, list[Any]] = {c: [r.get(c) for r in rows] for c in LEDGER_COLUMNS}
    if rows:
        cols["dtypes"] = [_join(v) for v in cols["dtypes"]]
        cols["shapes"] = [v if isinstance(v, str) else json.dumps(v) for v in cols["shapes"]]
        cols["group_ranks"] = [_json_or_none(v) for v in cols["group_ranks"]]
        for c in ("send", "recv"):  # peer -> "dtype:numel,...": what this rank sends to / receives from each peer
            cols[c] = [_json_or_none(v) for v in cols[c]]
        cols["session"] = ["" if v is None else v for v in cols["session"]]
        cols["attempt"] = [0 if v is None else v for v in cols["attempt"]]
        cols["group"] = ["0" if v is None else str(v) for v in cols["group"]]
        cols["state"] = ["completed" if v is None else v for v in cols["state"]]
    df = pd.DataFrame(cols, columns=LEDGER_COLUMNS)
    for c in _INT_LEDGER:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    for c in ("t_start", "t_end"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    return df.sort_values(["session", "attempt", "rank", "group", "seq"], ignore_index=True) if len(df) else df


def from_flight_recorder(path: str | os.PathLike, prefix: str | None = None) -> pd.DataFrame:
    """Flight Recorder dumps of a real job (NCCL or gloo, pickle or JSON) as the ledger table.

    ``path``: a directory of per-rank dumps (``<prefix><rank>``) or one dump file. The
    result feeds ``first_divergence``, ``diagnose`` and ``wb.viz.swimlane`` unchanged.
    Conversion details: ``workbench.analysis.flightrecorder``.
    """
    from workbench.analysis.flightrecorder import rows_from_flight_recorder

    return ledger_table(rows_from_flight_recorder(path, prefix))


def to_flight_recorder(ledger: pd.DataFrame, out_dir: str | os.PathLike, prefix: str = "nccl_trace_rank_",
                       backend: str | None = None) -> list:
    """The ledger as one Flight Recorder dump per rank, for ``torchfrtrace OUT_DIR`` (see ``flightrecorder``)."""
    from workbench.analysis import flightrecorder

    return flightrecorder.to_flight_recorder(ledger, out_dir, prefix, backend)


def _join(v: Any) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return ""
    return v if isinstance(v, str) else ",".join(str(x) for x in v)


def describe(call: dict[str, Any] | pd.Series | None) -> str:
    """One call in words: ``all_reduce #9 float32 [2] 8 B (group 0) at file:line``."""
    if call is None:
        return "no call"
    c = dict(call)
    shapes = c.get("shapes") or ""
    if isinstance(shapes, str) and shapes.startswith("[[") and shapes.count("[") == 2:
        shapes = shapes[1:-1]  # one tensor: [64], not [[64]]
    text = f"{c['op']} #{c['seq']} {c.get('dtypes') or '?'} {shapes} {human_bytes(c.get('bytes'))}".rstrip()
    if c.get("via") and isinstance(c.get("via"), str):
        n = c.get("bucket_tensors")
        text += f" (bucket {c.get('bucket')} of {c['via']}" + (f", {n} tensors)" if is_number(n) else ")")
    src = c.get("src")
    if is_number(src) and c["op"] in ("broadcast", "reduce", "scatter", "gather", "recv"):
        # the root as the user's code names it (a global rank), c10d's group rank beside it where it differs
        text += f" src={int(src)}"
        local = c.get("group_src")
        if is_number(local) and int(local) != int(src):
            text += f" (group rank {int(local)})"
    if isinstance(c.get("label"), str) and c["label"]:  # what the issuing code said the call is for
        text += f" [{c['label']}]"
    where = c.get("user_frame") or c.get("caller")
    return text + placed(where if isinstance(where, str) else "", library_line(c))


def placed(user: str, lib: str) -> str:
    """`` at <the user's line> (in <the library's line>)``: where the user's code reached the call (or raised),
    and beside it the innermost line of the library that issued it; one of them alone where the other is
    unknown or the same line; empty when neither is known."""
    if lib and lib != user:
        return f" at {short_path(user)} (in {short_path(lib)})" if user else f" at {short_path(lib)}"
    return f" at {short_path(user)}" if user else ""


# torch's own modules that issue collectives (FSDP, DTensor, the state-dict loaders, DDP in torch/nn/parallel) and
# autograd's engine (DDP's reducer issues its all-reduces from C++ inside a backward); a bundle scrubs the path to
# <site-packages>/torch/...
_TORCH_ISSUER = re.compile(r"(^|[/\\]|>)torch[/\\](distributed|nn[/\\]parallel|autograd)[/\\]")


def library_line(c: dict[str, Any]) -> str:
    """The row's library line: the one its rank recorded, else, for a row recorded before the ledger named torch's
    own modules (a bundle, a Flight Recorder import), its first frame past the c10d plumbing where that is one of
    torch's modules that issue collectives (``rank/ledger.place`` is the rule)."""
    lib = c.get("library_frame")
    if isinstance(lib, str) and lib:
        return lib
    caller = c.get("caller")
    if isinstance(caller, str) and caller != c.get("user_frame") and _TORCH_ISSUER.search(caller.split(":")[0]):
        return caller
    return ""


def is_number(v: Any) -> bool:
    """A value a table cell really holds (not None, NaN or NA)."""
    return v is not None and not (isinstance(v, float) and pd.isna(v)) and v is not pd.NA


def human_bytes(b: Any) -> str:
    """``16 B``, ``833.9 KiB``, ``12.0 MiB``; empty when unknown."""
    if not is_number(b):
        return ""
    b = int(b)
    return f"{b} B" if b < 10_000 else f"{b / 1024:.1f} KiB" if b < 10_000_000 else f"{b / 2**20:.1f} MiB"


def short_path(where: str) -> str:
    """``path:line`` from the package (or notebook) folder on, not the machine's whole path."""
    path, _, rest = where.partition(":")
    parts = path.split(os.sep)
    for anchor in ("site-packages", "<site-packages>", "dist-packages", "workbench", "notebooks"):
        if anchor in parts:  # a bundle's scrubbed paths start <site-packages>/accelerate/...
            parts = parts[parts.index(anchor) + anchor.endswith("-packages>") + anchor.endswith("-packages"):]
            break
    else:
        parts = parts[-2:]
    return "/".join(parts) + ":" + rest


# -- first divergence ---------------------------------------------------------------------
@dataclass
class Divergence:
    """The first call on which the ranks disagree, and what they disagree about."""

    kind: str  # "extra" (a call others did not make), "op", "dtype", "size", "root"
    group: str
    seq: int
    ranks: list[int]  # the ranks that deviate (for "extra": the ranks that made the call)
    calls: dict[int, dict[str, Any] | None]  # rank -> its call at this position (None: no call)
    message: str
    step: str | None = None

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def call(self) -> dict[str, Any] | None:
        """The deviating call (for "extra": the call the other ranks never made)."""
        return self.calls.get(self.rank)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "group": self.group, "seq": self.seq, "ranks": self.ranks, "step": self.step,
                "message": self.message}

    def __str__(self) -> str:
        return self.message


def _sig(c: dict[str, Any]) -> tuple:
    return (c.get("op"), c.get("dtypes"), c.get("numel"), c.get("src") if c.get("op") in ROOTED else None)


def _loose(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return a is not None and b is not None and a.get("op") == b.get("op") and a.get("dtypes") == b.get("dtypes")


def _retyped(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same call made with another dtype: same op and element count, different dtypes (a stale cached
    spec, a cast on one side). Read as a dtype mismatch of that call, never as an extra call."""
    return (a.get("op") == b.get("op") and a.get("dtypes") != b.get("dtypes")
            and is_number(a.get("numel")) and _nz(a.get("numel")) == _nz(b.get("numel")))


def first_divergence(ledger: pd.DataFrame) -> Divergence | None:
    """The earliest call on which the ranks disagree (per session attempt and group), or None."""
    found = divergences(ledger)
    return found[0] if found else None


def divergences(ledger: pd.DataFrame) -> list[Divergence]:
    """Each group's first divergence (per session attempt), earliest first: on a mesh, groups that share no
    rank can part each on its own, and each is a story of its own."""
    if ledger is None or ledger.empty:
        return []
    found: list[tuple[float, Divergence]] = []
    open_calls = ledger[ledger["state"] == OPEN]
    for (session, attempt, group), part in ledger.groupby(["session", "attempt", "group"], sort=False):
        div = _group_divergence(str(group), part)
        if div is not None:
            times = [c.get("t_start") for c in div.calls.values() if c is not None and is_number(c.get("t_start"))]
            t = min(times) if times else float(div.seq)
            held = open_calls[(open_calls["session"] == session) & (open_calls["attempt"] == attempt)]
            found.append((max([t, *_held_elsewhere(held, div)]), div))
    return [d for _, d in sorted(found, key=lambda x: x[0])]


def _held_elsewhere(open_calls: pd.DataFrame, div: Divergence) -> list[float]:
    """When each rank missing from ``div`` entered a call it never left on another group (``open_calls``: the
    run's calls still open): until then it could not have issued this one, so the parting dates from there (on
    a mesh, workers wait for the sender long before the sender dies in a trainer collective: that death comes
    first, not their wait)."""
    absent = [r for r, c in div.calls.items() if c is None]
    held = open_calls[open_calls["rank"].isin(absent) & (open_calls["group"].astype(str) != div.group)]
    return [float(t) for t in held["t_start"] if is_number(t)]


def group_ranks(part: pd.DataFrame) -> list[int]:
    """The ranks of a group: those seen in its rows plus the members the rows name."""
    ranks = {int(r) for r in part["rank"]}
    for v in part["group_ranks"].dropna().unique():
        try:
            ranks |= {int(r) for r in json.loads(v)}
        except (TypeError, ValueError):
            pass
    return sorted(ranks)


def _group_divergence(group: str, part: pd.DataFrame) -> Divergence | None:
    ranks = group_ranks(part)
    ordered = part.sort_values("seq", kind="stable")
    calls = {r: ordered[ordered["rank"] == r].to_dict("records") for r in ranks}  # records: 10x iterrows
    length = max(len(v) for v in calls.values())
    for k in range(length):
        at = {r: (calls[r][k] if k < len(calls[r]) else None) for r in ranks}
        present = [r for r in ranks if at[r] is not None]
        ref = at[present[0]]
        seq = int(ref["seq"]) if is_number(ref.get("seq")) else k + 1
        # where the ranks part: the step of the earliest-issued of these calls (a rank that went on past
        # a released call issues its next one steps later)
        timed = [at[r] for r in present if is_number(at[r].get("t_start"))]
        step = (min(timed, key=lambda c: float(c["t_start"])) if timed else ref).get("step")
        # Every rank runs the same step at once, and a step ends only when every rank returns: one call number
        # issued in two steps means a rank finished the earlier step without it (a released call's peer goes
        # on, and its next call takes that number). The parting is in the earlier step.
        late = [r for r in present if isinstance(at[r].get("step"), str) and at[r].get("step") != step]
        if late and isinstance(step, str):
            early = [r for r in present if r not in late]
            msg = (f"group {group} call #{seq}: rank(s) {early} issued {describe(at[early[0]])} in step {step!r}; "
                   f"rank(s) {late} issued no call #{seq} in that step (theirs came in step {at[late[0]]['step']!r})")
            return Divergence("extra", group, seq, early, {**at, **{r: None for r in late}}, msg, step)
        if len(present) < len(ranks):
            absent = [r for r in ranks if at[r] is None]
            msg = (f"group {group} call #{seq}: rank(s) {present} issued {describe(ref)}; "
                   f"rank(s) {absent} never issued a call #{seq} on this group")
            return Divergence("extra", group, seq, present, at, msg, step)
        kinds = {r: mismatch_kind(at[r], ref) for r in present}
        if not any(kinds.values()):
            continue
        # An extra call: one rank's next call is what the others issued here.
        for r in present:
            nxt = calls[r][k + 1] if k + 1 < len(calls[r]) else None
            others = [q for q in present if q != r]
            # ... and it issued more calls than they did: with equal counts it is a mismatch, not an extra
            if (all(_loose(nxt, at[q]) for q in others) and not any(_loose(at[r], at[q]) for q in others)
                    and all(len(calls[r]) > len(calls[q]) for q in others)
                    and not any(_retyped(at[r], at[q]) for q in others)):
                msg = (f"group {group} call #{seq}: rank {r} issued an extra {describe(at[r])} that rank(s) {others} "
                       f"did not; their call #{seq} ({'; '.join(f'rank {q}: {describe(at[q])}' for q in others)}) "
                       f"pairs with it instead, and rank {r}'s next call #{seq + 1} is {describe(nxt)}")
                return Divergence("extra", group, seq, [r], at, msg, step)
        deviating = [r for r in present if kinds[r]]
        kind = next(kinds[r] for r in deviating)
        words = {"op": "different collectives", "dtype": "different dtypes", "size": "different sizes",
                 "root": "different roots"}[kind]
        msg = (f"group {group} call #{seq}: {words}: "
               + "; ".join(f"rank {r}: {describe(at[r])}" for r in present))
        return Divergence(kind, group, seq, deviating, at, msg, step)
    return None


# -- hangs --------------------------------------------------------------------------------
def last_calls(ledger: pd.DataFrame) -> pd.DataFrame:
    """Each rank's last call in the ledger (latest start), one row per rank."""
    if ledger is None or ledger.empty:
        return ledger_table([])
    return (ledger.sort_values(["rank", "t_start", "seq"]).groupby("rank", as_index=False).tail(1)
            .reset_index(drop=True))


@dataclass
class Hang:
    """A step that did not finish on every rank: who is inside which collective, who returned."""

    step: str
    ranks: pd.DataFrame  # rank, status, op, seq, group, state, dtypes, shapes, bytes, where
    divergence: Divergence | None
    deadline_s: float | None = None
    stuck: dict[int, str] = field(default_factory=dict)  # rank -> "all_reduce #9 ..."
    finished: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    caught_by: str = "step deadline"  # or "ledger deadlock", "collective timeout", "strict mode (...)", "engine died",
    # "engine stopped"
    proof: str | None = None  # a deadlock read from the ledgers: why the open calls can never pair
    blocked_at: float | None = None  # ledger time the last rank entered its open call
    declared_at: float | None = None  # when the client declared the hang
    stacks: dict[int, str] = field(default_factory=dict)  # rank -> Python stacks while it was stuck

    @property
    def message(self) -> str:
        head = {"engine died": "a rank's engine died",
                "engine stopped": "a rank's engine was stopped (SIGSTOP or Ctrl-Z) and dropped by the controller",
                "collective timeout": "a collective timed out (the process group's own timeout)",
                }.get(self.caught_by, "strict mode (TORCH_DISTRIBUTED_DEBUG=DETAIL) caught a collective mismatch")
        if self.caught_by == "ledger deadlock":
            head = "deadlocked, read from the ledgers before any timeout" + (
                f" ({self.declared_at - self.blocked_at:.2f}s after the last rank blocked)"
                if self.declared_at and self.blocked_at else "")
        if self.caught_by == "step deadline":
            head = "did not finish on every rank" + (f" within its {self.deadline_s:g}s deadline"
                                                      if self.deadline_s else "")
        lines = [f"step {self.step!r}: {head}"]
        for r in self.ranks.itertuples():
            lines.append(f"  rank {r.rank}: {r.status}")
        if self.proof:
            lines.append(f"  proof: {self.proof}")
        if self.divergence is not None:
            lines.append(f"  first divergence: {self.divergence.message}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "deadline_s": self.deadline_s, "caught_by": self.caught_by,
                "stuck": {str(k): v for k, v in self.stuck.items()},
                "finished": self.finished, "dead": self.dead, "message": self.message, "proof": self.proof,
                "stacks": {str(k): v for k, v in self.stacks.items()},
                "detected_after_s": (self.declared_at - self.blocked_at
                                     if self.declared_at and self.blocked_at else None),
                "divergence": None if self.divergence is None else self.divergence.to_dict()}

    def __str__(self) -> str:
        return self.message

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.message)}</pre>"


def diagnose(step: str, ledger: pd.DataFrame, failures: dict[int, RankFailure], ranks: list[int],
             deadline_s: float | None = None) -> Hang:
    """Who is stuck where, from the ledger (no rank needs to answer) and the per-rank failures."""
    last = {int(r["rank"]): dict(r) for _, r in last_calls(ledger).iterrows()}
    queued: dict[int, int] = {}
    if ledger is not None and len(ledger):
        # NCCL is asynchronous: a rank can queue calls behind the one it waits in; its earliest open call is "where".
        for r, part in ledger[ledger["state"] == OPEN].sort_values(["t_start", "seq"]).groupby("rank"):
            last[int(r)] = dict(part.iloc[0])
            queued[int(r)] = len(part) - 1
    rows, stuck, finished, dead = [], {}, [], []
    for r in ranks:
        call, fail = last.get(r), failures.get(r)
        if fail is not None and fail.kind in LOST:
            status = fail.kind + (f" (last call: {describe(call)}, {call['state']})" if call else "")
            dead.append(r)
        elif call is not None and call["state"] == OPEN:
            status = f"inside {describe(call)}" + (f" ({queued[r]} more queued behind it)" if queued.get(r) else "")
            stuck[r] = describe(call)
        elif fail is not None and fail.kind == "timeout":
            status = "still running, in no collective" + (f" (last call: {describe(call)})" if call else "")
            stuck[r] = "no collective"
        elif call is not None and call["state"] in ("timed out", "failed"):
            status = f"returned: its {describe(call)} {call['state']}: {str(call.get('error') or '')[:160]}"
            finished.append(r)
        else:
            status = "returned" + (f" after {describe(call)}" if call else ", no collective")
            finished.append(r)
        rows.append({"rank": r, "status": status, **{k: (call or {}).get(k) for k in
                     ("op", "seq", "group", "state", "dtypes", "shapes", "bytes", "user_frame", "caller")}})
    return Hang(step, pd.DataFrame(rows), first_divergence(ledger), deadline_s, stuck, finished, dead,
                caught_by(failures, ledger))


STRICT = "Detected mismatch between collectives"


def caught_by(failures: dict[int, RankFailure], ledger: pd.DataFrame) -> str:
    """Which mechanism stopped the step: a dead engine, the step deadline, strict mode or gloo's timeout."""
    errors = " ".join(str(e) for e in ledger["error"].dropna()) if ledger is not None and len(ledger) else ""
    errors += " ".join(f.message for f in failures.values())
    if any(f.kind == "died" for f in failures.values()):
        return "engine died"
    if any(f.kind == "stopped" for f in failures.values()):
        return "engine stopped"
    if any(f.error == "Deadlock" for f in failures.values()):
        return "ledger deadlock"
    if STRICT in errors:
        return "strict mode (TORCH_DISTRIBUTED_DEBUG=DETAIL)"
    if any(f.kind == "timeout" for f in failures.values()):
        return "step deadline"
    return "collective timeout"


def any_timed_out(rows: Iterable[dict[str, Any]]) -> bool:
    """Whether raw ledger rows hold a timed-out call or strict mode's mismatch: the part of
    ``is_hang`` a step with no failed rank can still meet, without building the table."""
    return any(r.get("state") == "timed out" or STRICT in str(r.get("error") or "") for r in rows)


def is_hang(failures: dict[int, RankFailure], ledger: pd.DataFrame, errored: Iterable[int] = ()) -> bool:
    """A step hung (or would have): a rank missed its deadline or died, a collective timed out, strict
    mode caught a mismatch, or a rank in ``errored`` returned while its call stayed open (NCCL
    returns at once; the probe's wait for the stuck stream is what gives up)."""
    if any(f.kind in ("timeout", *LOST) for f in failures.values()):
        return True
    if ledger is None or not len(ledger):
        return False
    if set(errored) & {int(r) for r in ledger.loc[ledger["state"] == OPEN, "rank"]}:
        return True
    return bool((ledger["state"] == "timed out").any() or ledger["error"].fillna("").str.contains(STRICT).any())
