"""A run as the diagnosis reads it: its tables, and the facts its rules ask for, each computed once.

``Run.of(record)`` reads anything with ``tensors``, ``outputs``, ``events``, ``ledger``, ``trace``
tables, ``notes`` and a ``manifest`` (a RunRecord, duck-typed so this module stays below the
postmortem layer), once per record: asked again for the same record (a comparison, the report's
lines), it returns the same ``Run``, whose facts (who is stuck, the bad outputs, the divergences, the
first exception) are computed when first asked for. The functions below answer one question each
(which tensors are still wrong, what a bucket held, which groups parted) for the rules in
``workbench.analysis.diagnosis_rules``; what the rules say is ``workbench.analysis.diagnosis_words``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import pandas as pd

from workbench.analysis import collectives, findings, floor
from workbench.analysis.collectives import is_number
from workbench.errors import LOST

BAD = ("poison", "nan", "inf", "reference", "dtype", "differs")  # "missing": ranks may hold different tensors
TABLES = ("tensors", "outputs", "events", "ledger", "trace")


def _table(rec: Any, name: str) -> pd.DataFrame:
    df = getattr(rec, name, None)
    return df if isinstance(df, pd.DataFrame) else pd.DataFrame()


# -- reading a run --------------------------------------------------------------------------
@dataclass
class Run:
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
    def of(cls, rec: Any) -> Run:
        """The run ``rec`` holds, read once per record: the same ``Run`` (and so its facts) while the record holds
        the same tables, manifest and notes; ``rec`` itself when it is a ``Run``."""
        if isinstance(rec, Run):
            return rec
        key, own = _key(rec), _own(rec)
        hit = own.get(CACHED) if own is not None else None
        if hit is not None and _same(hit[0], key):
            return hit[1]
        run = cls._read(rec)
        if own is not None:  # a record without an instance dict of its own is read each time
            own[CACHED] = (key, run)
        return run

    @classmethod
    def _read(cls, rec: Any) -> Run:
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

    @cached_property
    def ranks(self) -> list[int]:
        n = self.manifest.get("ranks")
        seen = {int(r) for df in (self.tensors, self.events, self.ledger) if "rank" in df for r in df["rank"].dropna()}
        return sorted(seen | set(range(int(n)))) if n else sorted(seen)

    @cached_property
    def names(self) -> list[str]:
        return list(dict.fromkeys(self.tensors["name"])) if "name" in self.tensors else []

    @cached_property
    def kinds(self) -> dict[str, str]:
        if "kind" not in self.tensors:
            return {}
        return dict(zip(self.tensors["name"], self.tensors["kind"]))

    # -- the facts the rules, the grid and a comparison share: each computed once, when first asked for --------
    @cached_property
    def stuck(self) -> list[dict[str, Any]]:
        """Who timed out, hung or died, and in which call (``where_stuck``)."""
        return where_stuck(self)

    @cached_property
    def bad_outputs(self) -> list[dict[str, Any]]:
        """The last step's outputs that are non-finite or depart (``bad_outputs``)."""
        return bad_outputs(self)

    @cached_property
    def divergences(self) -> list[collectives.Divergence]:
        """Each group's first divergence, earliest first."""
        return collectives.divergences(self.ledger) if len(self.ledger) else []

    @cached_property
    def first_error(self) -> Any:
        """The first step's first ``error`` event, or None."""
        return first_error(self)


CACHED = "_wb_diagnosis_run"  # the record's own slot for (what it held when read, its Run)


def _own(rec: Any) -> dict[str, Any] | None:
    """The record's instance dict, where its ``Run`` is kept: the cache lives and dies with the record (no global
    table keyed by ``id()``, which a new object may reuse), and is written past ``__setattr__`` so a frozen
    dataclass or an unhashable one (``RunRecord``) holds it too; None when the record has no dict of its own."""
    own = getattr(rec, "__dict__", None)
    return own if type(own) is dict else None


def _key(rec: Any) -> tuple:
    """What a record held when it was read: its tables (the objects), a copy of its manifest, its notes."""
    notes = getattr(rec, "notes", None)
    return (*(getattr(rec, n, None) for n in TABLES), dict(getattr(rec, "manifest", {}) or {}),
            list(notes) if isinstance(notes, list) else None)


def _same(a: tuple, b: tuple) -> bool:
    n = len(TABLES)
    try:
        return all(x is y for x, y in zip(a[:n], b[:n])) and bool(a[n:] == b[n:])
    except (TypeError, ValueError):  # values that do not compare as one truth value (arrays): read it again
        return False


def persistent_faults(run: Run) -> pd.DataFrame:
    """(rank, name, status, since, detail) for tensors wrong at the last step they were probed in, with the
    first step of the unbroken run of wrong steps that led there."""
    rows = []
    per: dict[tuple[int, str], list[tuple[str, str, str]]] = {}
    fps = {(s, int(r), n): f for s in run.steps for r, n, f in
           run.at(run.tensors, s)[["rank", "name", "fingerprint"]].itertuples(index=False)} if len(run.tensors) else {}
    for s in run.steps:
        for r in run.status[s].itertuples(index=False):
            per.setdefault((int(r.rank), r.name), []).append((s, r.status, r.detail))
    together = _moved_together(run, fps)
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
            # where the probe says which ranks agree: the reference copy moved too (a training step), not a rewrite
            moved = (seq[j - 1][0], seq[j][0], name) in together
            if a != b and a not in (None, "meta") and b not in (None, "meta") and not derived and not moved:
                k = j
                break
        rows.append({"rank": rank, "name": name, "status": seq[-1][1], "since": seq[k][0],
                     "since_status": seq[k][1], "detail": seq[-1][2], "last": seq[-1][0]})
    return pd.DataFrame(rows, columns=["rank", "name", "status", "since", "since_status", "detail", "last"])


def _moved_together(run: Run, fps: dict[tuple[str, int, str], Any]) -> set[tuple[str, str, str]]:
    """(step before, step, name) where a tensor's reference copy (the lowest rank of its ``agree`` group) changed
    from one step to the next: every replica was updated (an optimizer step), so a copy that stayed apart was
    not rewritten there. Empty for records whose probe did not say what must agree."""
    t = run.tensors
    if "agree" not in t or not len(t):
        return set()
    refs = {(s, n): findings.agree_ranks(a)[0] for s, n, a in t[["step", "name", "agree"]].itertuples(index=False)
            if findings.agree_ranks(a)}
    out = set()
    for before, now in zip(run.steps, run.steps[1:]):
        for (s, name), r in refs.items():
            if s == now and fps.get((before, r, name)) not in (None, fps.get((now, r, name))):
                out.add((before, now, name))
    return out


SELF_EVIDENT = ("poison", "nan", "inf", "reference")  # wrong on its own terms, whatever the other ranks hold


def first_faults(run: Run, before: str | None) -> pd.DataFrame:
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


def bad_outputs(run: Run) -> list[dict[str, Any]]:
    """Outputs of the last step that are non-finite, depart from the reference, or from rank 0."""
    o = run.outputs
    if o.empty:
        return []
    if "step_index" in o:
        o = o[o["step_index"] == o["step_index"].max()]
    ref = {r.name: r.fingerprint for r in o[o["rank"] == 0].itertuples(index=False)}
    if "ref_max_abs_diff" in o and o["ref_max_abs_diff"].map(is_number).any():
        ref = {}  # the scenario says what right is: ranks may differ by design (roles, shards)
    learned = "agree" in o  # the probe said which outputs must agree (rank/agree.py): only those are compared
    held = findings.output_held(o)
    out = []
    for r in o.itertuples(index=False):
        diff = getattr(r, "ref_max_abs_diff", None)
        nan = int(r.nan) if is_number(r.nan) else 0
        if nan:
            out.append({"step": r.step, "rank": int(r.rank), "name": r.name, "how": f"{nan} of {r.numel} values NaN"})
        elif floor.departs(diff, getattr(r, "ref_floor", None)):
            out.append({"step": r.step, "rank": int(r.rank), "name": r.name,
                        "how": floor.words(diff, getattr(r, "ref_floor", None))})
        elif learned:
            apart = findings.output_apart(r, held, by_inputs=bool(ref))  # a reference says what right is
            if apart is not None:
                out.append({"step": r.step, "rank": int(r.rank), "name": r.name, "how": apart})
        elif int(r.rank) != 0 and r.name in ref and ref[r.name] != r.fingerprint \
                and not _true(getattr(r, "sharded", None)):  # a rank-local output (ctx.local) differs by design
            out.append({"step": r.step, "rank": int(r.rank), "name": r.name, "how": "differs from rank 0"})
    return out


# -- what the ledger says ---------------------------------------------------------------------
def bucket_names(run: Run, rank: int, call: dict[str, Any]) -> list[str]:
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


def where_stuck(run: Run) -> list[dict[str, Any]]:
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
                op = _hung_op(what)
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


def _hung_op(what: str) -> str:
    """The call a hang record's ``stuck`` words name (``all_reduce #9 (float32 [2]) [...]`` -> ``all_reduce
    #9``): the manifest keeps a hang as the words the live session said, so this is the one place they are read."""
    if what == "no collective":
        return what
    return " ".join(what.split(" (")[0].split(" [")[0].split()[:2])


def split_before(run: Run, upto: str | None, dtypes: set[str]) -> tuple[str, list[str], dict] | None:
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


def members(run: Run, div: collectives.Divergence) -> set[int]:
    led = run.ledger
    return set(collectives.group_ranks(led[led["group"].astype(str) == str(div.group)])) | set(div.calls)


def independent(run: Run, div: collectives.Divergence) -> list[collectives.Divergence]:
    """The other groups that part in the same step and share no rank with ``div``'s group or each other."""
    out, taken = [], members(run, div)
    for other in run.divergences[1:]:
        mine = members(run, other)
        if other.step == div.step and other.group != div.group and not mine & taken:
            out.append(other)
            taken |= mine
    return out


def parted_members(run: Run, call: dict[str, Any] | None) -> list[int]:
    """The ranks of the group ``call`` (a parting story's first divergent call) is on (empty when unknown)."""
    call, led = call or {}, run.ledger
    if not call or not len(led) or call.get("group") is None:
        return []
    return collectives.group_ranks(led[led["group"].astype(str) == str(call["group"])])


def first_error(run: Run) -> Any:
    ev = run.events
    if not len(ev) or "kind" not in ev.columns:
        return None
    errors = ev[ev["kind"] == "error"]
    if not len(errors):
        return None
    return min(errors.itertuples(index=False), key=lambda e: run.index(e.step))


def last_call(run: Run, rank: int) -> dict[str, Any] | None:
    if run.ledger.empty:
        return None
    mine = run.ledger[run.ledger["rank"] == rank]
    return dict(mine.sort_values("t_start").iloc[-1]) if len(mine) else None


ties = findings.ties  # the pairs of names one tensor is held under in a step's rows


def broken_tie(run: Run, step: str, names: list[str]) -> tuple[str, str] | None:
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
