"""A run as the diagnosis reads it: the tables, the facts its rules ask for, and the small words they say.

``Run.of(record)`` reads anything with ``tensors``, ``outputs``, ``events``, ``ledger``, ``trace``
tables, ``notes`` and a ``manifest`` (a RunRecord, duck-typed so this module stays below the
postmortem layer). The functions below answer one question each (which tensors are still wrong,
who hung, what a bucket held, which ranks raised) and are shared by the rules in
``workbench.analysis.diagnosis_rules``; ``Diagnosis`` is what a rule says.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from workbench.analysis import collectives, findings, floor
from workbench.analysis.collectives import is_number
from workbench.analysis.frames import fmt
from workbench.analysis.rankgroups import ranks_words
from workbench.errors import LOST

BAD = ("poison", "nan", "inf", "reference", "dtype", "differs")  # "missing": ranks may hold different tensors
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
EVIDENCE_COLUMNS = ["step", "rank", "what", "fact"]
GRID_COLUMNS = ["step", "step_index", "rank", "status", "label"]
GRID_STATUSES = ["ok", "fault", "failed", "hung", "not run"]
PART_WORDS = {"op": "different collectives", "dtype": "different dtypes", "size": "different sizes",
              "root": "different roots"}  # how two sides of a parted call differ (else: "an extra call")


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


def named(names: list[str], among: list[str], n: int = 3) -> str:
    out = ", ".join(f"`{short(x, among)}`" for x in names[:n])
    return out + (f" and {len(names) - n} more" if len(names) > n else "")




def possessive(ranks: list[int]) -> str:
    """``rank 1's``, ``ranks 1-7's``: whose tensor a sentence is about, as one group."""
    return ranks_words(ranks) + "'s"


def by_value(pairs: Iterable[tuple[int, Any]]) -> dict[Any, list[int]]:
    """``(rank, value)`` pairs -> ``{value: [ranks]}``, values in the order they first come."""
    out: dict[Any, list[int]] = {}
    for r, v in pairs:
        out.setdefault(v, []).append(int(r))
    return out


def calls_by_group(calls: dict[int, Any]) -> str:
    """Where ranks part, one clause per distinct call: ``rank 0: all_reduce #9 …; ranks 1-7: all_gather …``.

    At 8 or 64 ranks the ranks on one side issue the same call; listing each would bury the two sides."""
    groups = by_value((r, collectives.describe(c)) for r, c in sorted(calls.items()) if c)
    return "; ".join(f"{ranks_words(rs)}: {text}" for text, rs in groups.items())


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


def outputs_clause(bad: list[dict[str, Any]]) -> str:
    if not bad:
        return ""
    by: dict[tuple[str, str], list[int]] = {}
    for b in bad:
        by.setdefault((b["name"], b["how"]), []).append(b["rank"])
    parts = [f"`{n}` on {ranks_words(rs)}: {how}" for (n, how), rs in list(by.items())[:2]]
    return "; output " + "; ".join(parts)


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


def size_of(call: dict[str, Any]) -> str:
    return collectives.human_bytes(call.get("bytes"))


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


def stuck_clause(stuck: list[dict[str, Any]]) -> str:
    """``; rank 0 hung in …; ranks 1-7 …``: ranks stuck the same way read as one group."""
    return "".join(f"; {ranks_words(rs)} {how}" for how, rs in by_value((s["rank"], s["how"]) for s in stuck).items())


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
    for other in collectives.divergences(run.ledger)[1:]:
        mine = members(run, other)
        if other.step == div.step and other.group != div.group and not mine & taken:
            out.append(other)
            taken |= mine
    return out


def parting(run: Run, div: collectives.Divergence) -> str:
    """One group's parting in a clause: ``on group 3 (ranks 0,3): the ranks' collectives part at call #1
    (different roots): rank 0: …; rank 3: …``."""
    head = f"on group {div.group} ({ranks_words(sorted(members(run, div)))}): "
    absent = [r for r, c in div.calls.items() if c is None]
    if absent:
        present = [r for r, c in div.calls.items() if c is not None]
        return (head + f"{ranks_words(absent)} never issued call #{div.seq} that {ranks_words(present)} issued "
                f"({collectives.describe(div.calls[present[0]])})")
    words = PART_WORDS.get(div.kind, "an extra call")
    return head + f"the ranks' collectives part at call #{div.seq} ({words}): {calls_by_group(div.calls)}"


def ev_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=EVIDENCE_COLUMNS)
    df["rank"] = df["rank"].astype("Int64")
    return df



def named_raisers(sentence: str) -> set[tuple[int, str]]:
    """(rank, exception type) pairs a sentence already tells: ``rank 1 raised X``, ``ranks 0,3-5 raised Y``."""
    out: set[tuple[int, str]] = set()
    for m in re.finditer(r"\branks? ([\d,\-]+) raised (\w+)", sentence):
        for part in m.group(1).split(","):
            a, _, b = part.partition("-")
            if a.isdigit():
                out |= {(r, m.group(2)) for r in range(int(a), int(b if b.isdigit() else a) + 1)}
    return out


def parted_members(run: Run, d: Diagnosis) -> list[int]:
    """The ranks of the group whose collectives part in ``d`` (empty when unknown)."""
    call, led = d.call or {}, run.ledger
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


def from_error(run: Run, step: str) -> Diagnosis:
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
                     ev_frame([{"step": x.step, "rank": x.rank, "what": x.error, "fact": str(x.message)[:300]}
                          for x in ev[ev["kind"] == "error"].itertuples(index=False)]))



def floor_clause(run: Run) -> str:
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


def last_call(run: Run, rank: int) -> dict[str, Any] | None:
    if run.ledger.empty:
        return None
    mine = run.ledger[run.ledger["rank"] == rank]
    return dict(mine.sort_values("t_start").iloc[-1]) if len(mine) else None


def real_before(run: Run, step: str, names: list[str], ranks: list[int]) -> str:
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
