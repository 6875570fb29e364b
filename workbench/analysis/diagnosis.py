"""The diagnosis: the first place a run went wrong, classified, in one sentence.

The detectors (``findings``, ``collectives``, ``trace``) each answer one question per
step; an engineer in an incident wants the story. ``diagnose(record)`` walks a run in
causal order and keeps only what explains the end state:

1. the collectives ledger: the first call on which the ranks disagree (an extra bucket,
   a different op, a rank that never issued the call), then what it left behind on the
   receiving rank (bytes of another dtype or tensor, tensors nobody wrote) and who then
   timed out, hung or died;
2. a rank that died or hung with no disagreement in the ledger;
3. tensors still wrong at the last step, traced back to the step they went wrong in and
   stayed wrong from: never written since materialisation, the same wrong value on every
   rank (only the reference sees it), a dtype split, plain divergence;
4. outputs that depart while every probed tensor agrees: the cause is outside the probe.

Faults that a later step repairs (rank 1's tensors between ``to_empty`` and the state
dict load) are not causes. ``record`` is anything with ``tensors``, ``outputs``,
``events``, ``ledger``, ``trace`` tables and a ``manifest`` (a RunRecord, duck-typed so
this module stays below the postmortem layer). The figure is built by
``workbench.viz.diagnosis.figure`` from ``Diagnosis.grid``.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from workbench.analysis import cause, collectives, findings, floor, weightsync
from workbench.analysis.collectives import is_number
from workbench.analysis.frames import fmt
from workbench.analysis.rankgroups import ranks_words as _ranks
from workbench.errors import LOST

BAD = ("poison", "nan", "inf", "reference", "dtype", "differs")  # "missing": ranks may hold different tensors
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
EVIDENCE_COLUMNS = ["step", "rank", "what", "fact"]
GRID_COLUMNS = ["step", "step_index", "rank", "status", "label"]
GRID_STATUSES = ["ok", "fault", "failed", "hung", "not run"]


@dataclass
class Diagnosis:
    """What went wrong first: mechanism, step, ranks, tensor, call; one sentence; the rows behind it."""

    mechanism: str  # "clean", "reinterpreted", "mispaired", "collective-mismatch", "rank-missing", ...
    sentence: str
    step: str | None = None  # the first step of the story
    ranks: list[int] = field(default_factory=list)
    tensor: str | None = None
    call: dict[str, Any] | None = None  # the first divergent ledger call (the deviating rank's)
    evidence: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=EVIDENCE_COLUMNS))
    grid: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=GRID_COLUMNS))  # for the figure
    parted: dict[str, Any] | None = None  # comparison: where bug and fix runs part
    fix: Diagnosis | None = None  # comparison: the fix run's own diagnosis

    @property
    def clean(self) -> bool:
        return self.mechanism == "clean"

    def to_dict(self) -> dict[str, Any]:
        from workbench.analysis.frames import jsonable, records

        return {"mechanism": self.mechanism, "sentence": self.sentence, "step": self.step, "ranks": self.ranks,
                "tensor": self.tensor, "call": jsonable(self.call), "evidence": records(self.evidence),
                "parted": jsonable(self.parted), "fix": None if self.fix is None else self.fix.to_dict()}

    def __str__(self) -> str:
        return self.sentence

    def __repr__(self) -> str:
        return f"<Diagnosis {self.mechanism}: {self.sentence}>"

    def _repr_html_(self) -> str:
        rows = self.evidence.to_html(index=False) if len(self.evidence) else ""
        return f"<p><b>{html.escape(self.mechanism)}</b>: {html.escape(self.sentence)}</p>{rows}"


# -- small words --------------------------------------------------------------------------
def dt(dtype: Any) -> str:
    return SHORT_DTYPES.get(str(dtype), str(dtype))


def short(name: str, among: list[str] | None = None) -> str:
    """The shortest dotted suffix of ``name`` that no other name in ``among`` ends with (never starting at a
    bare index: ``layers.0.mlp``, not ``0.mlp``)."""
    parts = str(name).split(".")
    others = [n for n in (among or []) if n != name]
    for k in range(1, len(parts) + 1):
        if k < len(parts) and parts[-k].isdigit():
            continue
        tail = ".".join(parts[-k:])
        if not any(o == tail or o.endswith("." + tail) for o in others):
            return tail
    return str(name)


def _names(names: list[str], among: list[str], n: int = 3) -> str:
    out = ", ".join(f"`{short(x, among)}`" for x in names[:n])
    return out + (f" and {len(names) - n} more" if len(names) > n else "")




def _possessive(ranks: list[int]) -> str:
    """``rank 1's``, ``ranks 1-7's``: whose tensor a sentence is about, as one group."""
    return _ranks(ranks) + "'s"


def _by_value(pairs: Iterable[tuple[int, Any]]) -> dict[Any, list[int]]:
    """``(rank, value)`` pairs -> ``{value: [ranks]}``, values in the order they first come."""
    out: dict[Any, list[int]] = {}
    for r, v in pairs:
        out.setdefault(v, []).append(int(r))
    return out


def _calls_by_group(calls: dict[int, Any]) -> str:
    """Where ranks part, one clause per distinct call: ``rank 0: all_reduce #9 …; ranks 1-7: all_gather …``.

    At 8 or 64 ranks the ranks on one side issue the same call; listing each would bury the two sides."""
    groups = _by_value((r, collectives.describe(c)) for r, c in sorted(calls.items()) if c)
    return "; ".join(f"{_ranks(rs)}: {text}" for text, rs in groups.items())


def _table(rec: Any, name: str) -> pd.DataFrame:
    df = getattr(rec, name, None)
    return df if isinstance(df, pd.DataFrame) else pd.DataFrame()


# -- reading a run --------------------------------------------------------------------------
@dataclass
class _Run:
    steps: list[str]
    tensors: pd.DataFrame
    outputs: pd.DataFrame
    events: pd.DataFrame
    ledger: pd.DataFrame
    trace: pd.DataFrame
    manifest: dict[str, Any]
    status: dict[str, pd.DataFrame]  # step -> status table
    notes: list[dict[str, Any]] = field(default_factory=list)  # the ranks' notes (weight-sync plan/stream orders)

    @classmethod
    def of(cls, rec: Any) -> _Run:
        manifest = dict(getattr(rec, "manifest", {}) or {})
        tensors, events = _table(rec, "tensors"), _table(rec, "events")
        steps = list(manifest.get("steps_run") or [])
        for df in (tensors, events):
            if "step" in df:
                steps += [s for s in dict.fromkeys(df["step"]) if s not in steps]
        status = {}
        for s in steps:
            t = tensors[tensors["step"] == s] if "step" in tensors else tensors.iloc[0:0]
            status[s] = findings.status(t) if len(t) else pd.DataFrame(columns=["rank", "name", "status", "detail"])
        notes = getattr(rec, "notes", None)
        return cls(steps, tensors, _table(rec, "outputs"), events, _table(rec, "ledger"), _table(rec, "trace"),
                   manifest, status, notes if isinstance(notes, list) else [])

    def at(self, df: pd.DataFrame, step: str) -> pd.DataFrame:
        return df[df["step"] == step] if "step" in df and len(df) else df.iloc[0:0]

    def index(self, step: str | None) -> int:
        return self.steps.index(step) if step in self.steps else len(self.steps)

    @property
    def ranks(self) -> list[int]:
        n = self.manifest.get("ranks")
        seen = {int(r) for df in (self.tensors, self.events, self.ledger) if "rank" in df for r in df["rank"].dropna()}
        return sorted(seen | set(range(int(n)))) if n else sorted(seen)

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(self.tensors["name"])) if "name" in self.tensors else []

    @property
    def kinds(self) -> dict[str, str]:
        if "kind" not in self.tensors:
            return {}
        return dict(zip(self.tensors["name"], self.tensors["kind"]))


def _persistent_faults(run: _Run) -> pd.DataFrame:
    """(rank, name, status, since, detail) for tensors wrong at the last step they were probed in, with the
    first step of the unbroken run of wrong steps that led there."""
    rows = []
    per: dict[tuple[int, str], list[tuple[str, str, str]]] = {}
    fps = {(s, int(r), n): f for s in run.steps for r, n, f in
           run.at(run.tensors, s)[["rank", "name", "fingerprint"]].itertuples(index=False)} if len(run.tensors) else {}
    for s in run.steps:
        for r in run.status[s].itertuples(index=False):
            per.setdefault((int(r.rank), r.name), []).append((s, r.status, r.detail))
    for (rank, name), seq in per.items():
        if seq[-1][1] not in BAD:
            continue
        k = len(seq) - 1
        while k > 0 and seq[k - 1][1] in BAD:
            k -= 1
        # within that run, the step that last wrote the (wrong) content: a stale copy overwritten wrongly
        # was wrong "since" the write, not since the copy was made
        for j in range(len(seq) - 1, k, -1):
            a, b = fps.get((seq[j - 1][0], rank, name)), fps.get((seq[j][0], rank, name))
            derived = seq[j - 1][1] == "poison" and seq[j][1] == "nan"  # arithmetic on never-written memory
            if a != b and a not in (None, "meta") and b not in (None, "meta") and not derived:
                k = j
                break
        rows.append({"rank": rank, "name": name, "status": seq[-1][1], "since": seq[k][0],
                     "since_status": seq[k][1], "detail": seq[-1][2], "last": seq[-1][0]})
    return pd.DataFrame(rows, columns=["rank", "name", "status", "since", "since_status", "detail", "last"])


SELF_EVIDENT = ("poison", "nan", "inf", "reference")  # wrong on its own terms, whatever the other ranks hold


def _first_faults(run: _Run, before: str | None) -> pd.DataFrame:
    """Faults of the earliest step before ``before`` where a tensor is wrong on its own terms."""
    stop = run.index(before)
    for s in run.steps[:stop]:
        st = run.status[s]
        bad = st[st["status"].isin(SELF_EVIDENT)] if len(st) else st
        if len(bad):
            return pd.DataFrame({"rank": bad["rank"].astype(int), "name": bad["name"], "status": bad["status"],
                                 "since": s, "since_status": bad["status"], "detail": bad["detail"], "last": s})
    return pd.DataFrame(columns=["rank", "name", "status", "since", "since_status", "detail", "last"])


def _true(v: Any) -> bool:
    """True for True and numpy's True; False for False, None, NaN and pandas' NA."""
    return (v.item() if hasattr(v, "item") else v) is True


def _bad_outputs(run: _Run) -> list[dict[str, Any]]:
    """Outputs of the last step that are non-finite, depart from the reference, or from rank 0."""
    o = run.outputs
    if o.empty:
        return []
    if "step_index" in o:
        o = o[o["step_index"] == o["step_index"].max()]
    ref = {r.name: r.fingerprint for r in o[o["rank"] == 0].itertuples(index=False)}
    if "ref_max_abs_diff" in o and o["ref_max_abs_diff"].map(is_number).any():
        ref = {}  # the scenario says what right is: ranks may differ by design (roles, shards)
    out = []
    for r in o.itertuples(index=False):
        diff = getattr(r, "ref_max_abs_diff", None)
        nan = int(r.nan) if is_number(r.nan) else 0
        if nan:
            out.append({"step": r.step, "rank": int(r.rank), "name": r.name, "how": f"{nan} of {r.numel} values NaN"})
        elif floor.departs(diff, getattr(r, "ref_floor", None)):
            out.append({"step": r.step, "rank": int(r.rank), "name": r.name,
                        "how": floor.words(diff, getattr(r, "ref_floor", None))})
        elif int(r.rank) != 0 and r.name in ref and ref[r.name] != r.fingerprint \
                and not _true(getattr(r, "sharded", None)):  # a rank-local output (ctx.local) differs by design
            out.append({"step": r.step, "rank": int(r.rank), "name": r.name, "how": "differs from rank 0"})
    return out


def _outputs_clause(bad: list[dict[str, Any]]) -> str:
    if not bad:
        return ""
    by: dict[tuple[str, str], list[int]] = {}
    for b in bad:
        by.setdefault((b["name"], b["how"]), []).append(b["rank"])
    parts = [f"`{n}` on {_ranks(rs)}: {how}" for (n, how), rs in list(by.items())[:2]]
    return "; output " + "; ".join(parts)


# -- what the ledger says ---------------------------------------------------------------------
def _bucket_names(run: _Run, rank: int, call: dict[str, Any]) -> list[str]:
    """The tensors a coalesced bucket held, inferred from ``rank``'s tensors of the call's dtype before the call."""
    dtype, n, numel = call.get("dtypes"), call.get("bucket_tensors"), call.get("numel")
    if not dtype or "," in str(dtype):
        return []
    upto = run.index(call.get("step"))
    for s in reversed(run.steps[:upto + 1]):
        t = run.at(run.tensors, s)
        t = t[(t["rank"] == rank) & (t["dtype"] == dtype) & ~t["is_meta"].fillna(False).astype(bool)]
        count_ok = not is_number(n) or len(t) == int(n)
        if len(t) and count_ok and (not is_number(numel) or int(t["numel"].sum()) == int(numel)):
            return list(t["name"])
    return []


def _size(call: dict[str, Any]) -> str:
    return collectives.human_bytes(call.get("bytes"))


def _where_stuck(run: _Run) -> list[dict[str, Any]]:
    """Who timed out, hung or died, and in which call: ledger states first, then hang records and events."""
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    stopped = {(int(e.rank), e.step) for e in run.events.itertuples(index=False) if e.kind == "stopped"} \
        if len(run.events) else set()
    led = run.ledger
    if len(led):
        for r in led[led["state"].isin(["timed out", "failed"])].sort_values("t_start").itertuples(index=False):
            if int(r.rank) not in seen:
                seen.add(int(r.rank))
                # a call the workbench aborted (a proven deadlock released, a recovery) was hung, not failed
                released = str(getattr(r, "error", "") or "").startswith("aborted by the workbench")
                how = (f"hung in {r.op} #{r.seq} (released by the workbench)" if released
                       else f"{r.state} in {r.op} #{r.seq}")
                out.append({"rank": int(r.rank), "step": r.step, "how": how, "call": r._asdict()})
    for h in run.manifest.get("hangs") or []:
        for rank, what in (h.get("stuck") or {}).items():
            if int(rank) not in seen:
                seen.add(int(rank))
                op = what.split(" (")[0].split(" [")[0]
                op = " ".join(op.split()[:2]) if what != "no collective" else "no collective"
                out.append({"rank": int(rank), "step": h.get("step"), "how": f"hung in {op} ({h.get('caught_by')})",
                            "call": None})
        for rank in h.get("dead") or []:
            if int(rank) not in seen:
                seen.add(int(rank))
                how = "stopped" if (int(rank), h.get("step")) in stopped else "died"
                out.append({"rank": int(rank), "step": h.get("step"), "how": how, "call": None})
    for e in run.events.itertuples(index=False) if len(run.events) else []:
        if int(e.rank) not in seen and e.kind in ("timeout", *LOST):
            seen.add(int(e.rank))
            out.append({"rank": int(e.rank), "step": e.step,
                        "how": e.kind if e.kind in LOST else "hung past the step deadline", "call": None})
    return out


def _stuck_clause(stuck: list[dict[str, Any]]) -> str:
    """``; rank 0 hung in …; ranks 1-7 …``: ranks stuck the same way read as one group."""
    return "".join(f"; {_ranks(rs)} {how}" for how, rs in _by_value((s["rank"], s["how"]) for s in stuck).items())


def _split_before(run: _Run, upto: str | None, dtypes: set[str]) -> tuple[str, list[str], dict] | None:
    """The step where tensors of one of ``dtypes`` split by dtype across ranks and stayed split into step
    ``upto`` (the state a call in ``upto`` started from; steps where too few ranks answered change nothing; meta
    tensors count: their dtype is what FSDP buckets by): (step, names, {rank: dtype})."""
    since: dict[str, str] = {}
    per: dict[str, dict[int, str]] = {}
    for s in run.steps[:run.index(upto)]:
        t = run.at(run.tensors, s)
        for name, g in t.groupby("name", sort=False):
            if g["rank"].nunique() < 2:
                continue
            if g["dtype"].nunique() > 1 and set(g["dtype"]) & dtypes:
                since.setdefault(name, s)
                per[name] = {int(r): d for r, d in zip(g["rank"], g["dtype"])}
            else:
                since.pop(name, None)
    if not since:
        return None
    first = min(since.values(), key=run.index)
    names = [n for n, s in since.items() if s == first]
    return first, names, per[names[0]]


def _members(run: _Run, div: collectives.Divergence) -> set[int]:
    led = run.ledger
    return set(collectives.group_ranks(led[led["group"].astype(str) == str(div.group)])) | set(div.calls)


def _independent(run: _Run, div: collectives.Divergence) -> list[collectives.Divergence]:
    """The other groups that part in the same step and share no rank with ``div``'s group or each other."""
    out, taken = [], _members(run, div)
    for other in collectives.divergences(run.ledger)[1:]:
        mine = _members(run, other)
        if other.step == div.step and other.group != div.group and not mine & taken:
            out.append(other)
            taken |= mine
    return out


def _parting(run: _Run, div: collectives.Divergence) -> str:
    """One group's parting in a clause: ``on group 3 (ranks 0,3): the ranks' collectives part at call #1
    (different roots): rank 0: …; rank 3: …``."""
    head = f"on group {div.group} ({_ranks(sorted(_members(run, div)))}): "
    absent = [r for r, c in div.calls.items() if c is None]
    if absent:
        present = [r for r, c in div.calls.items() if c is not None]
        return (head + f"{_ranks(absent)} never issued call #{div.seq} that {_ranks(present)} issued "
                f"({collectives.describe(div.calls[present[0]])})")
    words = {"op": "different collectives", "dtype": "different dtypes", "size": "different sizes",
             "root": "different roots"}.get(div.kind, "an extra call")
    return head + f"the ranks' collectives part at call #{div.seq} ({words}): {_calls_by_group(div.calls)}"


def _from_ledger(run: _Run, div: collectives.Divergence) -> Diagnosis:
    d = _from_ledger_one(run, div)
    also = _independent(run, div)
    if also:
        # every group that parted on its own is told, before what the ranks were left doing (the tail)
        more = "".join(f"; independently, {_parting(run, o)}" for o in also)
        tail = _stuck_clause(_where_stuck(run))
        d.sentence = (d.sentence[:-len(tail)] + more + tail) if tail and d.sentence.endswith(tail) \
            else d.sentence + more
        d.ranks = d.ranks + [r for o in also for r in sorted(o.ranks) if r not in d.ranks]
        d.evidence = pd.concat([d.evidence, _ev([{"step": o.step, "rank": None, "what": f"group {o.group}",
                                                  "fact": o.message} for o in also])], ignore_index=True)
    return d


def _from_ledger_one(run: _Run, div: collectives.Divergence) -> Diagnosis:
    among = run.names
    calls = {r: c for r, c in div.calls.items()}
    sender = div.rank
    call = calls.get(sender) or {}
    others = [r for r in calls if r != sender]
    evidence = [{"step": div.step, "rank": r, "what": f"{c['op']} #{c['seq']}" if c else "(no call)",
                 "fact": collectives.describe(c) if c else f"never issued call #{div.seq} on group {div.group}"}
                for r, c in sorted(calls.items())]
    stuck = _where_stuck(run)
    evidence += [{"step": s["step"], "rank": s["rank"], "what": "outcome", "fact": s["how"]} for s in stuck]
    absent = [r for r, c in calls.items() if c is None]
    if absent:
        sentence = (f"{_ranks(absent)} never issued group {div.group} call #{div.seq} that {_ranks(div.ranks)} "
                    f"issued in step `{div.step}` ({collectives.describe(call)})" + _stuck_clause(stuck))
        return Diagnosis("rank-missing", sentence, div.step, absent, None, call, _ev(evidence))

    dtypes = {str(c.get("dtypes")) for c in calls.values() if c}
    split = _split_before(run, div.step, dtypes)
    bucket = _bucket_names(run, sender, call) if call.get("via") else []
    receiver = others[0] if others else sender
    rcall = calls.get(receiver) or {}
    receivers = [r for r in others if (calls.get(r) or {}).get("dtypes") == rcall.get("dtypes")] or [receiver]
    if div.kind == "extra" and call.get("via"):
        what = (f"rank {sender} sent an extra {dt(call.get('dtypes'))} bucket ({call['op']} #{call['seq']}, "
                f"{_size(call)}" + (f": {_names(bucket, among)}" if bucket else "") + ")"
                f" that {_ranks(receivers)} received into {'its' if len(receivers) == 1 else 'their'} "
                f"{dt(rcall.get('dtypes'))} bucket")
        how = f"`{call['via']}` bucketed by dtype" + (f" after `{split[0]}` split the dtypes" if split else "")
        mechanism = "mispaired"
    else:
        what = _calls_by_group(calls)
        words = {"op": "different collectives", "dtype": "different dtypes", "size": "different sizes",
                 "root": "different roots"}.get(div.kind, "an extra call")
        how = f"the ranks' collectives part at group {div.group} call #{div.seq} in step `{div.step}` ({words})"
        mechanism = "collective-mismatch"
    if split:
        evidence.insert(0, {"step": split[0], "rank": None, "what": "dtype split",
                            "fact": f"{_names(split[1], among)}: " + ", ".join(
                                f"{dt(d)} on {_ranks(rs)}" for d, rs in _by_value(sorted(split[2].items())).items())})

    # what the mispaired transfer left behind on the receiving rank
    t = run.at(run.tensors, div.step)
    re_rows = [m for m in findings.reinterpretations(t) if m["rank"] != sender] if len(t) else []
    st = run.status.get(div.step, pd.DataFrame(columns=["rank", "name", "status"]))
    never = st[(st["rank"] == receiver) & (st["status"] == "poison")]["name"].tolist() if len(st) else []
    never_on = sorted(set(st[(st["status"] == "poison") & st["name"].isin(never)]["rank"])) if never else []
    for m in re_rows:
        evidence.append({"step": div.step, "rank": m["rank"], "what": m["name"], "fact": m["finding"]})
    if never:
        evidence.append({"step": div.step, "rank": receiver, "what": "never written",
                         "fact": f"{len(never)} tensor(s): {_names(never, among, 5)}"})
    rest = f"; the rest of {_possessive(never_on)} tensors were never written" if never else ""
    tail = rest + _stuck_clause(stuck) + _outputs_clause(_bad_outputs(run))
    first_step = split[0] if split else div.step
    if re_rows and mechanism == "mispaired":
        pick = next((m for m in re_rows if m["name"] == m["source"]), None) or \
            next((m for m in re_rows if m["source"] in bucket), re_rows[0])
        row = t[(t["rank"] == pick["rank"]) & (t["name"] == pick["name"])].iloc[0]
        src = t[(t["rank"] == sender) & (t["name"] == pick["source"])].iloc[0]
        same = pick["source"] == pick["name"]
        shift = f" from byte {pick['offset']}" if pick["offset"] else ""
        read_as = f" read as {dt(row['dtype'])}" if src["dtype"] != row["dtype"] else ""
        of = "" if same else f" of `{short(pick['source'], among)}`"
        alike_on = sorted({int(m["rank"]) for m in re_rows if (m["name"], m["source"], m["offset"])
                           == (pick["name"], pick["source"], pick["offset"])})  # the same mispairing on each
        head = f"{_possessive(alike_on)} `{short(pick['name'], among)}` is rank {sender}'s {dt(src['dtype'])} bytes" \
               f"{of}{shift}{read_as}"
        if pick.get("shift"):
            slid = abs(int(pick["shift"]))
            es = {"fp32": 4, "bf16": 2, "fp16": 2}.get(dt(row["dtype"]))
            amount = f"{slid // es} {dt(row['dtype'])} elements ({slid} B)" if es and slid % es == 0 else f"{slid} B"
            why = " (the extra bucket's size)" if is_number(call.get("bytes")) and int(call["bytes"]) == slid else ""
            alike = [m for m in re_rows if m.get("shift") == pick["shift"] and m["rank"] == pick["rank"]]
            more = f" and {len(alike) - 1} more of its tensors" if len(alike) > 1 else ""
            head = (f"rank {pick['rank']}'s `{short(pick['name'], among)}`{more} hold rank {sender}'s bytes slid by "
                    f"{amount}{why}")
        sentence = f"{head}: {how}, {what}{tail}"
        return Diagnosis("reinterpreted", sentence, first_step, alike_on, pick["name"], call, _ev(evidence))
    if mechanism == "mispaired":
        sentence = f"{how}, {what}{tail}"
        tensor = bucket[0] if bucket else None
        return Diagnosis("mispaired", sentence, first_step, [receiver], tensor, call, _ev(evidence))
    sentence = f"{how}: {what}{tail}"
    return Diagnosis("collective-mismatch", sentence, div.step, sorted(div.ranks), None, call, _ev(evidence))


def _ev(rows: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=EVIDENCE_COLUMNS)
    df["rank"] = df["rank"].astype("Int64")
    return df


# -- the walk ----------------------------------------------------------------------------------
def diagnose(record: Any) -> Diagnosis:
    """The first cause of what went wrong in one run (see the module docstring), or ``clean``."""
    run = _Run.of(record)
    d = _diagnose(run)
    d.grid = grid(run, d)
    return d


def _diagnose(run: _Run) -> Diagnosis:
    d = _diagnose_story(run)
    return _every_exception(run, d)


def _every_exception(run: _Run, d: Diagnosis) -> Diagnosis:
    """No rank's exception is left out: one the story did not name (a later step's, a rank outside the parted
    group) is added after it, one clause per distinct exception."""
    named = _named_raisers(d.sentence)
    ev = run.events
    if not len(ev) or "kind" not in ev.columns:
        return d
    for step in dict.fromkeys(ev[ev["kind"] == "error"]["step"]):
        missing = [e for e in cause.causes(ev, step) if (int(e["rank"]), str(e["error"])) not in named]
        if missing:
            d.sentence += "; " + "; ".join(cause.told(missing, step))
    return d


def _named_raisers(sentence: str) -> set[tuple[int, str]]:
    """(rank, exception type) pairs a sentence already tells: ``rank 1 raised X``, ``ranks 0,3-5 raised Y``."""
    out: set[tuple[int, str]] = set()
    for m in re.finditer(r"\branks? ([\d,\-]+) raised (\w+)", sentence):
        for part in m.group(1).split(","):
            a, _, b = part.partition("-")
            if a.isdigit():
                out |= {(r, m.group(2)) for r in range(int(a), int(b if b.isdigit() else a) + 1)}
    return out


def _parted_members(run: _Run, d: Diagnosis) -> list[int]:
    """The ranks of the group whose collectives part in ``d`` (empty when unknown)."""
    call, led = d.call or {}, run.ledger
    if not call or not len(led) or call.get("group") is None:
        return []
    return collectives.group_ranks(led[led["group"].astype(str) == str(call["group"])])


def _diagnose_story(run: _Run) -> Diagnosis:
    d = _diagnose_state(run)
    first = _first_error(run)
    if first is None:
        return d
    if d.clean:
        return _from_error(run, first.step)
    at, then = run.index(first.step), run.index(d.step)
    if at == then and d.mechanism in _PARTED:
        raised = cause.causes(run.events, d.step)
        raisers = {int(e["rank"]) for e in raised}
        members = _parted_members(run, d)
        if raised and members and not raisers & set(members):
            # Two failures of one step, on groups that share no rank: neither explains the other. Each is told,
            # the raising ranks' exceptions first (a cause), then the group whose collectives part (a symptom).
            group = (d.call or {}).get("group")
            d.sentence = ("; ".join(cause.told(raised, d.step))
                          + f"; independently, on group {group} ({_ranks(members)}): {d.sentence}")
            d.ranks = sorted(raisers) + [r for r in d.ranks if r not in raisers]
            return d
        if raised:  # the exception is the cause, the parted collectives what it left behind
            waiting = [s["rank"] for s in _where_stuck(run) if s["rank"] not in raisers]
            d.sentence = f"{cause.lead(raised, d.step, waiting)}: {d.sentence}"
            d.ranks = sorted(raisers) + [r for r in d.ranks if r not in raisers]
            return d
    # A rank raised before anything else went wrong (a check refusing a stream, a failed load), or
    # in the step where the state went wrong without a collective to blame: the exception is the
    # first cause, and what it left undone or half-written is the rest of the story.
    if at < then or (at == then and d.call is None and d.mechanism not in _OUTCOMES):
        e = _from_error(run, first.step)
        e.sentence += (f"; later, in step `{d.step}`: " if at < then else "; in the same step: ") + d.sentence
        e.evidence = pd.concat([e.evidence, d.evidence], ignore_index=True)
        return e
    return d


_OUTCOMES = ("rank-died", "hang")  # stories about ranks, which already name who raised
_PARTED = ("collective-mismatch", "rank-missing", "mispaired", "reinterpreted")  # stories read from the ledger


def _first_error(run: _Run) -> Any:
    ev = run.events
    if not len(ev) or "kind" not in ev.columns:
        return None
    errors = ev[ev["kind"] == "error"]
    if not len(errors):
        return None
    return min(errors.itertuples(index=False), key=lambda e: run.index(e.step))


def _from_error(run: _Run, step: str) -> Diagnosis:
    """Ranks that raised in ``step``: one sentence for one error, the others named by rank."""
    ev = run.events
    errors = ev[(ev["kind"] == "error") & (ev["step"] == step)]
    e = errors.iloc[0]
    same = errors[(errors["error"] == e["error"]) & (errors["message"] == e["message"])]
    ranks = sorted(int(r) for r in same["rank"])
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
    sentence = f"{who} raised {e['error']} in step `{step}`: {str(e['message'])[:200]}"
    others = errors[~errors.index.isin(same.index)]
    sentence += "".join(f"; rank {int(o.rank)} raised {o.error}" for o in others.itertuples(index=False))
    return Diagnosis("error", sentence, step, sorted(int(r) for r in errors["rank"]), None, None,
                     _ev([{"step": x.step, "rank": x.rank, "what": x.error, "fact": str(x.message)[:300]}
                          for x in ev[ev["kind"] == "error"].itertuples(index=False)]))


def _permuted(run: _Run) -> Diagnosis | None:
    """A packed weight stream whose order parts from the receiver's plan: every name from that index on
    loads whatever bytes sit at its planned offset. The first cause, however the bytes then look."""
    from workbench.analysis.weightsync_order import first_split

    sp = first_split(run.notes)
    if sp is None:
        return None
    step = sp["step"] if sp["step"] in run.steps else (run.steps[0] if run.steps else None)
    types = (f" ({sp['dtype_planned']} planned, {sp['dtype_streamed']} streamed)"
             if sp["dtype_planned"] != sp["dtype_streamed"] else "")
    sentence = (f"the receiver's plan and the sender's stream part at index {sp['index']} of stage {sp['stage']}"
                f"{types}: the plan lists `{short(str(sp['planned']))}` there, the stream carries "
                f"`{short(str(sp['streamed']))}`, so {sp['wrong']} of {sp['names']} planned names load other "
                "tensors' bytes")
    later = run.steps[run.index(step):] if step is not None else []
    caught = next((st for st in later if cause.causes(run.events, st)), None)  # an exception, not a collective's
    if caught is not None:
        sentence += f"; {_from_error(run, caught).sentence}"  # a check that caught it: loud, yet the same cause
    else:
        sentence += " and nothing raised"
    ev = [{"step": step, "rank": None, "what": "plan vs stream",
           "fact": f"index {sp['index']}: plan {sp['planned']!r}, stream {sp['streamed']!r}"}]
    return Diagnosis("permuted", sentence, step, [], sp["planned"], None, _ev(ev))


def _diagnose_state(run: _Run) -> Diagnosis:
    among = run.names
    div = collectives.first_divergence(run.ledger) if len(run.ledger) else None
    perm = _permuted(run)
    if perm is not None:
        if div is not None and run.index(div.step) >= run.index(perm.step):
            later = _from_ledger(run, div)
            perm.sentence += f"; later, in step `{div.step}`: {later.sentence}"
            perm.call = later.call
            perm.evidence = pd.concat([perm.evidence, later.evidence], ignore_index=True)
        else:
            perm.sentence += _outputs_clause(_bad_outputs(run))
        return perm
    if div is not None:
        early = _first_faults(run, before=div.step)
        if not len(early):
            return _from_ledger(run, div)
        # Causal order: a tensor already wrong on its own terms before the collectives parted
        # is the first cause (e.g. a silent permutation, then a hang in a later sync).
        d = _from_tensors(run, early, [], among)
        later = _from_ledger(run, div)
        d.sentence += f"; later, in step `{div.step}`: {later.sentence}"
        d.call = later.call
        d.evidence = pd.concat([d.evidence, later.evidence], ignore_index=True)
        return d
    stuck = _where_stuck(run)
    dead = [s for s in stuck if s["how"] in LOST]
    if dead:
        s = dead[0]
        ev = [{"step": x["step"], "rank": x["rank"], "what": "outcome", "fact": x["how"]} for x in stuck]
        last = _last_call(run, s["rank"])
        lost = "died" if s["how"] == "died" else "was stopped (SIGSTOP or Ctrl-Z), not dead,"
        sentence = (f"rank {s['rank']}'s engine {lost} in step `{s['step']}`"
                    + (f" (its last call: {collectives.describe(last)}, {last.get('state')})" if last else "")
                    + "".join(f"; rank {x['rank']} {x['how']}" for x in stuck if x is not s))
        return Diagnosis("rank-died", sentence, s["step"], [s["rank"]], None, last, _ev(ev))
    if stuck:
        ev = [{"step": x["step"], "rank": x["rank"], "what": "outcome", "fact": x["how"]} for x in stuck]
        s = stuck[0]
        sentence = (f"step `{s['step']}` did not finish: " + "; ".join(f"rank {x['rank']} {x['how']}" for x in stuck)
                    + "; the ranks' ledgers agree call for call, so no collective was mispaired")
        return Diagnosis("hang", sentence, s["step"], [x["rank"] for x in stuck], None, s.get("call"), _ev(ev))

    faults = _persistent_faults(run)
    bad_out = _bad_outputs(run)
    kinds = run.kinds
    if len(faults) and not bad_out and len(run.outputs):
        # tensors that hold per-rank values by design ("tensor" probes) may differ when the outputs agree
        faults = faults[~((faults["status"] == "differs") & (faults["name"].map(kinds) == "tensor"))]
    if len(faults):
        return _from_tensors(run, faults, bad_out, among)
    if bad_out:
        ranks = sorted({b["rank"] for b in bad_out})
        where = ""
        if len(run.trace):
            from workbench.analysis.trace import first_fault

            mod = first_fault(run.trace, ranks[0])
            where = f"; the forward trace first departs at `{mod}`" if mod else ""
        sentence = (f"outputs depart at step `{bad_out[0]['step']}`{_outputs_clause(bad_out)}{where}, while every "
                    "probed tensor agrees across ranks and with its reference: the cause is outside what was probed")
        return Diagnosis("outputs-only", sentence, bad_out[0]["step"], ranks, None, None,
                         _ev([{"step": b["step"], "rank": b["rank"], "what": b["name"], "fact": b["how"]}
                              for b in bad_out]))
    planned = len(run.manifest.get("steps") or run.steps)
    if len(run.steps) < planned:
        return Diagnosis("clean", f"clean so far: {len(run.steps)} of {planned} steps ran on every rank, the ranks "
                         "agree and no detector fired on the latest state" + _floor_clause(run), None)
    return Diagnosis("clean", f"clean: all {len(run.steps)} step(s) ran on every rank, the ranks agree and no "
                     "detector fired on the final state" + _floor_clause(run), None)


def _floor_clause(run: _Run) -> str:
    """For outputs judged against an engine's own floor: both numbers, so a reader on another CPU sees why
    0.066 reads clean (``; output `logprobs` 0.066 from the reference, the engine's own floor 0.066 ...``)."""
    o = run.outputs
    if o.empty or "ref_floor" not in o:
        return ""
    o = o[o["ref_floor"].map(floor.floor_of).notna()]
    if "step_index" in o and len(o):
        o = o[o["step_index"] == o["step_index"].max()]
    parts = []
    for name, g in o.groupby("name", sort=False):
        worst = g.loc[g["ref_max_abs_diff"].map(lambda v: floor.number(v) or 0.0).idxmax()]
        parts.append(floor.within_words(name, worst["ref_max_abs_diff"], worst["ref_floor"]))
    return "; output " + "; ".join(parts[:2]) if parts else ""


def _last_call(run: _Run, rank: int) -> dict[str, Any] | None:
    if run.ledger.empty:
        return None
    mine = run.ledger[run.ledger["rank"] == rank]
    return dict(mine.sort_values("t_start").iloc[-1]) if len(mine) else None


def _real_before(run: _Run, step: str, names: list[str], ranks: list[int]) -> str:
    """How the never-written tensors looked one step earlier, when every one of them was already real
    memory (not meta) on every rank: then materialisation replaced a live tensor, not a placeholder.
    Empty when any of them was meta, absent or not probed there."""
    i = run.index(step)
    if i == 0 or i >= len(run.steps):
        return ""
    t = run.at(run.tensors, run.steps[i - 1])
    if t.empty or "is_meta" not in t:
        return ""
    rows = t[t["name"].isin(names) & t["rank"].isin(ranks)]
    if len(rows) != len(names) * len(ranks) or rows["is_meta"].map(_true).any():
        return ""
    first = rows.iloc[0]
    head = first.get("head") if "head" in rows else None
    head = [fmt(float(x)) for x in list(head)[:4]] if head is not None and not isinstance(head, str) else []
    values = f", first values [{', '.join(head)}]" if head else ""
    return f"{dt(first['dtype'])} on {first.get('device', '?')}{values}"


ties = findings.ties  # the pairs of names one tensor is held under in a step's rows


def broken_tie(run: _Run, step: str, names: list[str]) -> tuple[str, str] | None:
    """(name, partner): a tensor among ``names`` that was one tensor with ``partner`` (tied: one parameter
    under two names) in the step before ``step`` and is not in ``step``; None when no tie broke there."""
    i = run.index(step)
    if i == 0 or i >= len(run.steps):
        return None
    before, now = ties(run.at(run.tensors, run.steps[i - 1])), ties(run.at(run.tensors, step))
    for pair in sorted(before - now, key=sorted):
        for name in names:
            if name in pair:
                return name, next(iter(pair - {name}))
    return None


def _from_tensors(run: _Run, faults: pd.DataFrame, bad_out: list[dict[str, Any]], among: list[str]) -> Diagnosis:
    faults = faults.assign(order=faults["since"].map(run.index)).sort_values(["order", "rank"])
    first = faults.iloc[0]
    step = first["since"]
    all_ranks = run.ranks
    ev = [{"step": f.since, "rank": f.rank, "what": f.name, "fact": f"{f.status} since `{f.since}`: {f.detail}"}
          for f in faults.itertuples(index=False)][:50]
    ev += [{"step": b["step"], "rank": b["rank"], "what": b["name"], "fact": b["how"]} for b in bad_out]
    out = _outputs_clause(bad_out)
    at_first = faults[faults["since"] == step]
    never = at_first[(at_first["status"] == "poison") | (at_first["since_status"] == "poison")]
    if len(never):
        names = list(dict.fromkeys(never["name"]))
        ranks = sorted(set(never["rank"]))
        read = [s for s in run.steps[run.index(step):] if len(run.at(run.outputs, s))]
        agree = set(ranks) == set(all_ranks) and len(all_ranks) > 1
        real = _real_before(run, step, names, ranks)
        was = "was" if len(names) == 1 else "were"
        sentence = (f"{_names(names, among)} on {_ranks(ranks)} {was} real (not meta) before step `{step}` "
                    f"({real}) and {was} replaced there by memory never written since"
                    if real else
                    f"{_names(names, among)} on {_ranks(ranks)} {was} never written after materialisation at "
                    f"step `{step}`")
        kept = never[never["status"] == "nan"]
        sentence = (sentence
                    + (f": `{read[0]}` read the unwritten bytes" if read else ": still unwritten at the last step")
                    + (f"; in-place updates kept it NaN through step `{kept['last'].iloc[0]}`" if len(kept) else "")
                    + out + ("; every rank holds the same garbage, so a cross-rank check sees nothing"
                             if agree else ""))
        tie = broken_tie(run, step, names)
        if tie is not None:  # why it was never written: it stopped being the tensor that was
            name, partner = tie
            sentence += (f"; `{short(name, among)}` and `{short(partner, among)}` were one tensor (tied) until step "
                         f"`{step}` and are two after it: the tie broke there, so what was written into "
                         f"`{short(partner, among)}` never reached `{short(name, among)}` (tie them again after "
                         "materialising, e.g. `tie_weights()` after `to_empty`)")
            ev.insert(0, {"step": step, "rank": None, "what": "tie broken",
                          "fact": f"{name} shared {partner}'s tensor before step `{step}`, holds its own after"})
        return Diagnosis("never-written", sentence, step, ranks, names[0], None, _ev(ev))
    ref = at_first[at_first["status"] == "reference"]
    synced = weightsync.match_matrix(run, step) if len(ref) else pd.DataFrame(columns=weightsync.MATCH_COLUMNS)
    for status, mechanism, what in (("mislabel", "mislabeled", "hold another exported tensor's bytes"),
                                    ("cast", "lossy-cast", "hold the trainer's values rounded by the sync's cast")):
        hits = list(synced[synced["status"] == status]["finding"])
        if hits:
            # A weight sync loaded names with the wrong content: say whose tensor each one now holds.
            ranks = sorted(set(ref["rank"]))
            sentence = (f"{hits[0]}: {len(hits)} loaded name(s) {what} from step `{step}` on, and nothing raised"
                        + out)
            via = weightsync.sliced_with(run, step) if status == "mislabel" else None
            if via is not None:
                ws = via["workers"]
                who = (f"worker {ws[0]} sliced trainer rank {ws[0]}'s buffer" if len(ws) == 1 else
                       f"{_ranks(ws).replace('ranks', 'workers', 1)} sliced their own trainer ranks' buffers")
                sentence = f"{who} with rank {via['rank']}'s metadata (names and offsets): {sentence}"
            ev = [{"step": step, "rank": None, "what": status, "fact": m} for m in hits[:20]] + ev
            return Diagnosis(mechanism, sentence, step, ranks, str(ref["name"].iloc[0]), None, _ev(ev))
    if len(ref):
        names = list(dict.fromkeys(ref["name"]))
        ranks = sorted(set(ref["rank"]))
        t = run.at(run.tensors, step)
        g = t[t["name"] == names[0]]
        agree = set(g["rank"]) == set(all_ranks) and g["fingerprint"].nunique() == 1 and len(all_ranks) > 1
        worst = max((float(x) for x in g["ref_diff"] if is_number(x) and float(x) == float(x)), default=float("nan"))
        if agree:
            sentence = (f"every rank holds the same wrong {_names(names, among)} from step `{step}` (departs from "
                        f"its reference value by {fmt(worst)}): a cross-rank comparison sees nothing"
                        + out)
            return Diagnosis("agreed-wrong", sentence, step, ranks, names[0], None, _ev(ev))
        sentence = (f"{_names(names, among)} on {_ranks(ranks)} departs from its reference value "
                    f"(by {fmt(worst)}) from step `{step}`" + out)
        return Diagnosis("wrong-value", sentence, step, ranks, names[0], None, _ev(ev))
    split = at_first[at_first["since_status"] == "dtype"]
    if len(split):
        names = list(dict.fromkeys(split["name"]))
        t = run.at(run.tensors, step)
        g = t[t["name"] == names[0]]
        per = ", ".join(f"{dt(d)} on rank {int(r)}" for r, d in zip(g["rank"], g["dtype"]))
        sentence = (f"{_names(names, among)} split by dtype at step `{step}` ({per}) and stayed split" + out)
        return Diagnosis("dtype-split", sentence, step, sorted(set(split["rank"])), names[0], None, _ev(ev))
    names = list(dict.fromkeys(at_first["name"]))
    ranks = sorted(set(at_first["rank"]))
    sentence = (f"{_names(names, among)} on {_ranks(ranks)} {first['status']} from step `{step}` on "
                f"({first['detail']})" + out)
    return Diagnosis("diverged", sentence, step, ranks, names[0], None, _ev(ev))


# -- the figure's data ---------------------------------------------------------------------------
def grid(run: _Run | Any, d: Diagnosis | None = None) -> pd.DataFrame:
    """One cell per (step, rank): ok, fault (n tensors wrong), failed, hung or not run; what the figure draws."""
    run = run if isinstance(run, _Run) else _Run.of(run)
    stuck = {(s["step"], s["rank"]): s["how"] for s in _where_stuck(run)}
    errors = {(e.step, int(e.rank)): e.error for e in run.events.itertuples(index=False)} if len(run.events) else {}
    rows = []
    for i, s in enumerate(run.steps):
        st = run.status[s]
        split = _split_cells(run, s, d)
        # one pass per step, not one filter per rank: the grid stays linear in the ranks (256 ranks x 60 tensors)
        probed = set(st["rank"].astype(int)) if len(st) else set()
        bad_counts: dict[int, dict[str, int]] = {}
        if len(st):
            bad = st[st["status"].isin(BAD)]
            for (rank, status_), n in bad.groupby(["rank", "status"], sort=False).size().items():
                bad_counts.setdefault(int(rank), {})[status_] = int(n)
        for rank in run.ranks:
            if (s, rank) in stuck:
                status, label = ("failed" if "timed out" in stuck[(s, rank)] or "failed" in stuck[(s, rank)]
                                 else "hung"), stuck[(s, rank)]
            elif (s, rank) in errors:
                status, label = "failed", str(errors[(s, rank)])
            elif split and rank in split:
                status, label = "fault", f"dtype split ({split[rank]})"
            elif rank in bad_counts:
                counts = sorted(bad_counts[rank].items(), key=lambda kv: -kv[1])
                status, label = "fault", ", ".join(f"{n} {k}" for k, n in counts)
            elif rank in probed:
                status, label = "ok", "ok"
            else:
                status, label = "not run", "no rows"
            rows.append({"step": s, "step_index": i, "rank": rank, "status": status, "label": label})
    return pd.DataFrame(rows, columns=GRID_COLUMNS)


def _split_cells(run: _Run, step: str, d: Diagnosis | None) -> dict[int, str]:
    """rank -> its dtype, for the ranks whose copy of the diagnosed tensor has another dtype than rank 0's at
    the step the diagnosis starts in (meta copies included: the split is in the dtype, not the data)."""
    if d is None or d.step != step or not d.tensor:
        return {}
    t = run.at(run.tensors, step)
    g = t[t["name"] == d.tensor]
    ref = g[g["rank"] == 0]["dtype"]
    if ref.empty:
        return {}
    return {int(r): dt(x) for r, x in zip(g["rank"], g["dtype"]) if x != ref.iloc[0]}


# -- comparisons ----------------------------------------------------------------------------------
def parted(bug: Any, fix: Any, names: tuple[str, str] = ("the bug path", "the fix")) -> dict[str, Any] | None:
    """The first step where two runs hold different bytes (or dtypes) for some (rank, tensor), or different
    outputs; ``names`` says the two runs in the words of the answer."""
    a, b = _Run.of(bug), _Run.of(fix)
    for s in a.steps:
        if s not in b.steps:
            continue
        ta, tb = a.at(a.tensors, s), b.at(b.tensors, s)
        m = ta.merge(tb, on=["rank", "name"], how="outer", suffixes=("_bug", "_fix"), indicator="side")
        m = m.sort_values(["rank"], kind="stable")
        for r in m.itertuples(index=False):
            if r.side != "both":
                side = names[0] if r.side == "left_only" else names[1]
                return {"step": s, "rank": int(r.rank), "name": r.name, "what": f"only {side} has it"}
            if r.dtype_bug != r.dtype_fix:
                return {"step": s, "rank": int(r.rank), "name": r.name,
                        "what": f"{dt(r.dtype_bug)} in {names[0]}, {dt(r.dtype_fix)} in {names[1]}"}
            if r.fingerprint_bug != r.fingerprint_fix:
                return {"step": s, "rank": int(r.rank), "name": r.name, "what": "different bytes"}
        oa, ob = a.at(a.outputs, s), b.at(b.outputs, s)
        if len(oa) or len(ob):
            fa = dict(zip(zip(oa["rank"], oa["name"]), oa["fingerprint"])) if len(oa) else {}
            fb = dict(zip(zip(ob["rank"], ob["name"]), ob["fingerprint"])) if len(ob) else {}
            for key in sorted(set(fa) | set(fb), key=str):
                if fa.get(key) != fb.get(key):
                    return {"step": s, "rank": int(key[0]), "name": key[1],
                            "what": "different outputs" + _head_gap(oa, ob, key)}
    return None


def _head_gap(a: pd.DataFrame, b: pd.DataFrame, key: tuple) -> str:
    """How far apart the first values of one output are: rounding (1e-7) reads differently from a bug."""
    def head(df: pd.DataFrame) -> list[float]:
        row = df[(df["rank"] == key[0]) & (df["name"] == key[1])]
        if not len(row) or row["head"].iloc[0] is None:
            return []
        return [float("nan") if v is None else float(v) for v in list(row["head"].iloc[0])]  # NaN is stored as null

    ha, hb = head(a), head(b)
    gaps = [abs(x - y) for x, y in zip(ha, hb) if x == x and y == y]
    if not gaps or len(ha) != len(hb):
        return ""
    return f" (first {len(gaps)} values differ by at most {fmt(max(gaps))})"


def diagnose_comparison(bug: Any, fix: Any) -> Diagnosis:
    """The bug run's diagnosis, with the fix run's own and the first step where the two runs part."""
    d = diagnose(bug)
    d.fix = diagnose(fix)
    d.parted = parted(bug, fix)
    label = (getattr(fix, "manifest", {}) or {}).get("fix") or "the fix"
    if d.parted:
        p = d.parted
        d.sentence += (f". The fix `{label}` parts from the bug path at step `{p['step']}` (rank {p['rank']} "
                       f"`{short(p['name'], _Run.of(bug).names)}`: {p['what']})"
                       + (" and is clean" if d.fix.clean else f", but is not clean: {d.fix.sentence}"))
    else:
        d.sentence += f". The fix `{label}` holds the same bytes as the bug path at every step"
    return d
