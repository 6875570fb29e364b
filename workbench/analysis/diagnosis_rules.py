"""The diagnosis's rules, in the order they are tried: which finding tells the story, and what it says.

``RULES`` is the whole diagnosis, read top to bottom in four stages. In a stage, the first rule
whose ``when`` holds tells the story (its ``says``); then each rule of the stage that *adds* and
whose ``when`` holds adds its clause to that story.

- ``story``: the run's state, in causal order: a weight stream out of its plan, a tensor wrong before
  the collectives parted, the collectives parting, a rank that died or hung, tensors still wrong at
  the last step, outputs departing while every tensor agrees, else clean;
- ``parting``: how the first divergent collective reads (a rank that never issued it, a receiving
  rank's bytes reinterpreted, an extra bucket, different calls), then each group that parted on its own;
- ``tensor``: how the first wrong tensors read (never written, mislabeled or rounded by a weight
  sync, one wrong value on every rank, another value, a dtype split, plain divergence), then a tie that
  broke there;
- ``exception``: how a rank's exception joins the story (alone, independently, as the cause of the
  parting, before it), then each exception the sentence has not named yet.

A new finding is a rule put in its place in ``RULES``: a ``when`` and a ``says`` (an adding rule's
take the story so far as a second argument), each reading the stage's facts (``RunFacts``,
``PartFacts``, ``TensorFacts``: every fact computed once, when a rule first asks for it).
``rules()`` is the list as a table. Faults that a later step repairs are not causes (see
``persistent_faults``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pandas as pd

from workbench.analysis import cause, collectives, findings, weightsync
from workbench.analysis.collectives import is_number
from workbench.analysis.diagnosis_run import (
    PART_WORDS,
    Diagnosis,
    Run,
    bad_outputs,
    broken_tie,
    bucket_names,
    by_value,
    calls_by_group,
    dt,
    ev_frame,
    first_error,
    first_faults,
    floor_clause,
    from_error,
    independent,
    last_call,
    named,
    named_raisers,
    outputs_clause,
    parted_members,
    parting,
    persistent_faults,
    possessive,
    real_before,
    short,
    size_of,
    split_before,
    stuck_clause,
    where_stuck,
)
from workbench.analysis.frames import fmt
from workbench.analysis.rankgroups import ranks_words
from workbench.analysis.weightsync_order import first_split
from workbench.errors import LOST

OUTCOMES = ("rank-died", "hang")  # stories about ranks, which already name who raised
PARTED = ("collective-mismatch", "rank-missing", "mispaired", "reinterpreted")  # stories read from the ledger
STAGES = ("story", "parting", "tensor", "exception")


@dataclass(frozen=True)
class Rule:
    """One finding: in ``stage``, it fires ``when(facts)`` holds and ``says(facts)`` the story; a rule that
    ``adds`` takes the story so far, ``when(facts, story)`` and ``says(facts, story)``, and adds to it."""

    stage: str
    name: str
    when: Callable[..., bool]
    says: Callable[..., Diagnosis]
    adds: bool = False

    @property
    def fires_when(self) -> str:
        return _doc(self.when)

    @property
    def tells(self) -> str:
        return _doc(self.says)


def _doc(fn: Callable) -> str:
    """A function's docstring as one line: what the rules table shows."""
    return " ".join((fn.__doc__ or "").split())


def always(*_: Any) -> bool:
    """nothing above fired"""
    return True


def first(stage: str, facts: Any) -> Rule:
    """The rule that tells ``stage``'s story from ``facts``: the first of the stage whose ``when`` holds (each stage
    ends with one that always does)."""
    return next(r for r in RULES if r.stage == stage and not r.adds and r.when(facts))


def tell(stage: str, facts: Any) -> Diagnosis:
    """The story of ``stage``: the first of its rules that fires says it, then each adding rule that fires adds."""
    d = first(stage, facts).says(facts)
    for r in RULES:
        if r.stage == stage and r.adds and r.when(facts, d):
            d = r.says(facts, d)
    return d


def diagnose_run(run: Run) -> Diagnosis:
    """The story the run's state tells, then how its ranks' exceptions join it."""
    facts = RunFacts(run)
    facts.story = tell("story", facts)
    return tell("exception", facts)


def then(d: Diagnosis, step: str, later: Diagnosis) -> Diagnosis:
    """``d``, then ``later`` (what went wrong next, in ``step``) as its second part."""
    d.sentence += f"; later, in step `{step}`: {later.sentence}"
    d.call = later.call
    d.evidence = pd.concat([d.evidence, later.evidence], ignore_index=True)
    return d


def outcome_rows(stuck: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"step": x["step"], "rank": x["rank"], "what": "outcome", "fact": x["how"]} for x in stuck]


# -- stage "story" and stage "exception": the run ---------------------------------------------------
class RunFacts:
    """What the story and exception stages read; ``story`` is the story stage's answer, once told."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.story: Diagnosis | None = None

    @cached_property
    def div(self) -> collectives.Divergence | None:
        """The first ledger call on which the ranks disagree."""
        return collectives.first_divergence(self.run.ledger) if len(self.run.ledger) else None

    @cached_property
    def stream_split(self) -> dict[str, Any] | None:
        """Where a packed weight stream's order parts from the receiver's plan (the ranks' notes)."""
        return first_split(self.run.notes)

    @cached_property
    def early(self) -> pd.DataFrame:
        """Tensors wrong on their own terms before the collectives parted."""
        return first_faults(self.run, before=self.div.step)

    @cached_property
    def stuck(self) -> list[dict[str, Any]]:
        return where_stuck(self.run)

    @cached_property
    def dead(self) -> list[dict[str, Any]]:
        return [s for s in self.stuck if s["how"] in LOST]

    @cached_property
    def bad_out(self) -> list[dict[str, Any]]:
        return bad_outputs(self.run)

    @cached_property
    def faults(self) -> pd.DataFrame:
        """Tensors wrong at the last step; those holding per-rank values by design ("tensor" probes) may
        differ when the outputs agree."""
        faults, run = persistent_faults(self.run), self.run
        if len(faults) and not self.bad_out and len(run.outputs):
            kinds = run.kinds
            faults = faults[~((faults["status"] == "differs") & (faults["name"].map(kinds) == "tensor"))]
        return faults

    # the exception stage: the first exception against the story
    @cached_property
    def error(self) -> Any:
        """The first step's first ``error`` event, or None."""
        return first_error(self.run)

    @cached_property
    def same_step(self) -> bool:
        return self.run.index(self.error.step) == self.run.index(self.story.step)

    @cached_property
    def raised(self) -> list[dict[str, Any]]:
        """The exceptions of the story's step."""
        return cause.causes(self.run.events, self.story.step)

    @cached_property
    def raisers(self) -> set[int]:
        return {int(e["rank"]) for e in self.raised}


def when_permuted(f: RunFacts) -> bool:
    """a packed weight stream's order parts from the receiver's plan (the first cause, however the bytes look)"""
    return f.stream_split is not None


def says_permuted(f: RunFacts) -> Diagnosis:
    """the receiver's plan and the sender's stream part at index I of stage S: the plan lists `a` there, the
    stream carries `b`, so N of M planned names load other tensors' bytes (then the check that caught it, or
    'nothing raised'; then the collectives' parting, if later)"""
    run, sp = f.run, f.stream_split
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
        sentence += f"; {from_error(run, caught).sentence}"  # a check that caught it: loud, yet the same cause
    else:
        sentence += " and nothing raised"
    ev = [{"step": step, "rank": None, "what": "plan vs stream",
           "fact": f"index {sp['index']}: plan {sp['planned']!r}, stream {sp['streamed']!r}"}]
    d = Diagnosis("permuted", sentence, step, [], sp["planned"], None, ev_frame(ev))
    if f.div is not None and run.index(f.div.step) >= run.index(d.step):
        return then(d, f.div.step, tell("parting", PartFacts(run, f.div)))
    d.sentence += outputs_clause(f.bad_out)
    return d


def when_fault_before_parting(f: RunFacts) -> bool:
    """the collectives part, and a tensor was already wrong on its own terms (never written, NaN, off its
    reference) in an earlier step"""
    return f.div is not None and len(f.early) > 0


def says_fault_before_parting(f: RunFacts) -> Diagnosis:
    """the tensor stage's story of the early fault; later, in step `S`: the parting stage's story"""
    return then(tell("tensor", TensorFacts(f.run, f.early, [])), f.div.step, tell("parting", PartFacts(f.run, f.div)))


def when_parted(f: RunFacts) -> bool:
    """the ranks' collectives ledgers disagree on a call"""
    return f.div is not None


def says_parted(f: RunFacts) -> Diagnosis:
    """the parting stage's story"""
    return tell("parting", PartFacts(f.run, f.div))


def when_died(f: RunFacts) -> bool:
    """a rank died or was stopped, with the ledgers agreeing"""
    return bool(f.dead)


def says_died(f: RunFacts) -> Diagnosis:
    """rank R's engine died in step `S` (its last call: …); rank Q hung in …"""
    s = f.dead[0]
    last = last_call(f.run, s["rank"])
    lost = "died" if s["how"] == "died" else "was stopped (SIGSTOP or Ctrl-Z), not dead,"
    sentence = (f"rank {s['rank']}'s engine {lost} in step `{s['step']}`"
                + (f" (its last call: {collectives.describe(last)}, {last.get('state')})" if last else "")
                + "".join(f"; rank {x['rank']} {x['how']}" for x in f.stuck if x is not s))
    return Diagnosis("rank-died", sentence, s["step"], [s["rank"]], None, last, ev_frame(outcome_rows(f.stuck)))


def when_hung(f: RunFacts) -> bool:
    """a rank timed out or hung, with the ledgers agreeing"""
    return bool(f.stuck)


def says_hung(f: RunFacts) -> Diagnosis:
    """step `S` did not finish: rank R hung in …; the ranks' ledgers agree call for call, so no collective was
    mispaired"""
    stuck = f.stuck
    s = stuck[0]
    sentence = (f"step `{s['step']}` did not finish: " + "; ".join(f"rank {x['rank']} {x['how']}" for x in stuck)
                + "; the ranks' ledgers agree call for call, so no collective was mispaired")
    return Diagnosis("hang", sentence, s["step"], [x["rank"] for x in stuck], None, s.get("call"),
                     ev_frame(outcome_rows(stuck)))


def when_tensors_wrong(f: RunFacts) -> bool:
    """tensors are still wrong at the last step they were probed in"""
    return len(f.faults) > 0


def says_tensors_wrong(f: RunFacts) -> Diagnosis:
    """the tensor stage's story, from the step they went wrong in and stayed wrong from"""
    return tell("tensor", TensorFacts(f.run, f.faults, f.bad_out))


def when_outputs_only(f: RunFacts) -> bool:
    """outputs are non-finite or depart (from the reference or rank 0) while every probed tensor agrees"""
    return bool(f.bad_out)


def says_outputs_only(f: RunFacts) -> Diagnosis:
    """outputs depart at step `S`; output `o` on rank R: …; the forward trace first departs at `m`, while every
    probed tensor agrees across ranks and with its reference: the cause is outside what was probed"""
    run, bad_out = f.run, f.bad_out
    ranks = sorted({b["rank"] for b in bad_out})
    where = ""
    if len(run.trace):
        from workbench.analysis.trace import first_fault

        mod = first_fault(run.trace, ranks[0])
        where = f"; the forward trace first departs at `{mod}`" if mod else ""
    sentence = (f"outputs depart at step `{bad_out[0]['step']}`{outputs_clause(bad_out)}{where}, while every "
                "probed tensor agrees across ranks and with its reference: the cause is outside what was probed")
    return Diagnosis("outputs-only", sentence, bad_out[0]["step"], ranks, None, None,
                     ev_frame([{"step": b["step"], "rank": b["rank"], "what": b["name"], "fact": b["how"]}
                               for b in bad_out]))


def _planned(run: Run) -> int:
    return len(run.manifest.get("steps") or run.steps)


def when_clean_so_far(f: RunFacts) -> bool:
    """fewer steps ran than the run plans"""
    return len(f.run.steps) < _planned(f.run)


def says_clean_so_far(f: RunFacts) -> Diagnosis:
    """clean so far: K of N steps ran on every rank, the ranks agree and no detector fired on the latest state"""
    run = f.run
    return Diagnosis("clean", f"clean so far: {len(run.steps)} of {_planned(run)} steps ran on every rank, the ranks "
                     "agree and no detector fired on the latest state" + floor_clause(run), None)


def says_clean(f: RunFacts) -> Diagnosis:
    """clean: all N step(s) ran on every rank, the ranks agree and no detector fired on the final state"""
    run = f.run
    return Diagnosis("clean", f"clean: all {len(run.steps)} step(s) ran on every rank, the ranks agree and no "
                     "detector fired on the final state" + floor_clause(run), None)


def when_raised_alone(f: RunFacts) -> bool:
    """a rank raised and the state reads clean"""
    return f.error is not None and f.story.clean


def says_raised_alone(f: RunFacts) -> Diagnosis:
    """rank R raised E in step `S`: message (the others that raised then, by rank)"""
    return from_error(f.run, f.error.step)


def _parted_same_step(f: RunFacts) -> bool:
    return f.error is not None and f.same_step and f.story.mechanism in PARTED and bool(f.raised)


def when_raised_independently(f: RunFacts) -> bool:
    """ranks raised in the step whose collectives part, on ranks outside the parted group: neither failure
    explains the other"""
    if not _parted_same_step(f):
        return False
    members = parted_members(f.run, f.story)
    return bool(members) and not f.raisers & set(members)


def says_raised_independently(f: RunFacts) -> Diagnosis:
    """the raising ranks' exceptions (a cause); independently, on group G (ranks …): the parting's story (a
    symptom)"""
    d = f.story
    group = (d.call or {}).get("group")
    d.sentence = ("; ".join(cause.told(f.raised, d.step))
                  + f"; independently, on group {group} ({ranks_words(parted_members(f.run, d))}): {d.sentence}")
    d.ranks = sorted(f.raisers) + [r for r in d.ranks if r not in f.raisers]
    return d


def when_raised_leads(f: RunFacts) -> bool:
    """ranks raised in the step whose collectives part: the exception is the cause, the parting what it left"""
    return _parted_same_step(f)


def says_raised_leads(f: RunFacts) -> Diagnosis:
    """rank R raised E …, while ranks Q waited …: the parting's story"""
    d = f.story
    waiting = [s["rank"] for s in where_stuck(f.run) if s["rank"] not in f.raisers]
    d.sentence = f"{cause.lead(f.raised, d.step, waiting)}: {d.sentence}"
    d.ranks = sorted(f.raisers) + [r for r in d.ranks if r not in f.raisers]
    return d


def when_raised_first(f: RunFacts) -> bool:
    """a rank raised before the state went wrong (a check refusing a stream, a failed load), or in that step
    without a collective to blame"""
    if f.error is None:
        return False
    at, then_ = f.run.index(f.error.step), f.run.index(f.story.step)
    return at < then_ or (at == then_ and f.story.call is None and f.story.mechanism not in OUTCOMES)


def says_raised_first(f: RunFacts) -> Diagnosis:
    """the exception's story; later, in step `S` (or: in the same step): the state's story"""
    d = f.story
    e = from_error(f.run, f.error.step)
    e.sentence += (f"; later, in step `{d.step}`: " if not f.same_step else "; in the same step: ") + d.sentence
    e.evidence = pd.concat([e.evidence, d.evidence], ignore_index=True)
    return e


def says_story_stands(f: RunFacts) -> Diagnosis:
    """the state's story as it is (no exception, a later one, or one a rank's death or hang already names)"""
    return f.story


def _unnamed(f: RunFacts, d: Diagnosis) -> list[tuple[str, list[dict[str, Any]]]]:
    """(step, exceptions) the sentence does not name, per step with an error, in the order the steps first come."""
    ev = f.run.events
    if not len(ev) or "kind" not in ev.columns:
        return []
    told = named_raisers(d.sentence)
    out = []
    for step in dict.fromkeys(ev[ev["kind"] == "error"]["step"]):
        missing = [e for e in cause.causes(ev, step) if (int(e["rank"]), str(e["error"])) not in told]
        if missing:
            out.append((step, missing))
    return out


def when_exception_unnamed(f: RunFacts, d: Diagnosis) -> bool:
    """a rank's exception is not named yet (a later step's, a rank outside the parted group)"""
    return bool(_unnamed(f, d))


def says_exception_unnamed(f: RunFacts, d: Diagnosis) -> Diagnosis:
    """…; rank R raised E at file:line in step `S`: message (one clause per distinct exception)"""
    for step, missing in _unnamed(f, d):
        d.sentence += "; " + "; ".join(cause.told(missing, step))
    return d


# -- stage "parting": the first call on which the ranks' ledgers disagree ------------------------------
class PartFacts:
    """What the parting stage reads: one divergence, the calls on each side, what it left on the receivers."""

    def __init__(self, run: Run, div: collectives.Divergence) -> None:
        self.run, self.div = run, div
        self.among = run.names
        self.calls = dict(div.calls)
        self.sender = div.rank
        self.call = self.calls.get(self.sender) or {}
        self.absent = [r for r, c in self.calls.items() if c is None]
        others = [r for r in self.calls if r != self.sender]
        self.receiver = others[0] if others else self.sender
        self.rcall = self.calls.get(self.receiver) or {}
        self.receivers = [r for r in others if (self.calls.get(r) or {}).get("dtypes") == self.rcall.get("dtypes")] \
            or [self.receiver]

    @cached_property
    def stuck(self) -> list[dict[str, Any]]:
        return where_stuck(self.run)

    @cached_property
    def split(self) -> tuple[str, list[str], dict] | None:
        """Where tensors of the calls' dtypes split by dtype across ranks and stayed split into the call's step."""
        return split_before(self.run, self.div.step, {str(c.get("dtypes")) for c in self.calls.values() if c})

    @cached_property
    def bucket(self) -> list[str]:
        """The tensors the sender's coalesced bucket held."""
        return bucket_names(self.run, self.sender, self.call) if self.call.get("via") else []

    @property
    def extra_bucket(self) -> bool:
        """The sender issued a coalesced bucket the others did not."""
        return self.div.kind == "extra" and bool(self.call.get("via"))

    @cached_property
    def tensors(self) -> pd.DataFrame:
        return self.run.at(self.run.tensors, self.div.step)

    @cached_property
    def re_rows(self) -> list[dict[str, Any]]:
        """Tensors on ranks other than the sender holding another tensor's (or dtype's) bytes."""
        t = self.tensors
        return [m for m in findings.reinterpretations(t) if m["rank"] != self.sender] if len(t) else []

    @cached_property
    def never(self) -> list[str]:
        """The receiver's tensors never written in the call's step."""
        st = self.status
        return st[(st["rank"] == self.receiver) & (st["status"] == "poison")]["name"].tolist() if len(st) else []

    @cached_property
    def status(self) -> pd.DataFrame:
        return self.run.status.get(self.div.step, pd.DataFrame(columns=["rank", "name", "status"]))

    def call_rows(self) -> list[dict[str, Any]]:
        """Each rank's call (or its absence), then who timed out, hung or died."""
        div = self.div
        return [{"step": div.step, "rank": r, "what": f"{c['op']} #{c['seq']}" if c else "(no call)",
                 "fact": collectives.describe(c) if c else f"never issued call #{div.seq} on group {div.group}"}
                for r, c in sorted(self.calls.items())] + outcome_rows(self.stuck)

    def evidence(self) -> pd.DataFrame:
        """The dtype split first, the calls and outcomes, then what the transfer left behind."""
        rows, div, among = self.call_rows(), self.div, self.among
        if self.split:
            split = self.split
            per = by_value(sorted(split[2].items()))
            rows.insert(0, {"step": split[0], "rank": None, "what": "dtype split",
                            "fact": f"{named(split[1], among)}: " + ", ".join(
                                f"{dt(d)} on {ranks_words(rs)}" for d, rs in per.items())})
        rows += [{"step": div.step, "rank": m["rank"], "what": m["name"], "fact": m["finding"]} for m in self.re_rows]
        if self.never:
            rows.append({"step": div.step, "rank": self.receiver, "what": "never written",
                         "fact": f"{len(self.never)} tensor(s): {named(self.never, among, 5)}"})
        return ev_frame(rows)

    @cached_property
    def tail(self) -> str:
        """The rest of the receivers' tensors never written; who then hung or died; the outputs."""
        rest = ""
        if self.never:
            st = self.status
            never_on = sorted(set(st[(st["status"] == "poison") & st["name"].isin(self.never)]["rank"]))
            rest = f"; the rest of {possessive(never_on)} tensors were never written"
        return rest + stuck_clause(self.stuck) + outputs_clause(bad_outputs(self.run))

    @property
    def first_step(self) -> str:
        return self.split[0] if self.split else self.div.step

    @property
    def bucket_what(self) -> str:
        call, rcall, receivers = self.call, self.rcall, self.receivers
        return (f"rank {self.sender} sent an extra {dt(call.get('dtypes'))} bucket ({call['op']} #{call['seq']}, "
                f"{size_of(call)}" + (f": {named(self.bucket, self.among)}" if self.bucket else "") + ")"
                f" that {ranks_words(receivers)} received into {'its' if len(receivers) == 1 else 'their'} "
                f"{dt(rcall.get('dtypes'))} bucket")

    @property
    def bucket_how(self) -> str:
        return f"`{self.call['via']}` bucketed by dtype" + (f" after `{self.split[0]}` split the dtypes"
                                                            if self.split else "")

    @cached_property
    def also(self) -> list[collectives.Divergence]:
        """The other groups that part in the same step and share no rank with this one."""
        return independent(self.run, self.div)


def when_rank_missing(f: PartFacts) -> bool:
    """a rank never issued the call the others issued"""
    return bool(f.absent)


def says_rank_missing(f: PartFacts) -> Diagnosis:
    """rank R never issued group G call #N that ranks Q issued in step `S` (the call); who then hung or died"""
    div = f.div
    sentence = (f"{ranks_words(f.absent)} never issued group {div.group} call #{div.seq} that {ranks_words(div.ranks)} "
                f"issued in step `{div.step}` ({collectives.describe(f.call)})" + stuck_clause(f.stuck))
    return Diagnosis("rank-missing", sentence, div.step, f.absent, None, f.call, ev_frame(f.call_rows()))


def when_reinterpreted(f: PartFacts) -> bool:
    """an extra coalesced bucket was received, and a receiving rank's tensor holds the sender's bytes"""
    return f.extra_bucket and bool(f.re_rows)


def says_reinterpreted(f: PartFacts) -> Diagnosis:
    """rank R's `t` is rank S's fp32 bytes read as bf16 (or: slid by K elements): `via` bucketed by dtype after
    `step` split the dtypes, rank S sent an extra … bucket that rank R received into its … bucket; the rest"""
    re_rows, bucket, t, sender, among, call = f.re_rows, f.bucket, f.tensors, f.sender, f.among, f.call
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
    head = f"{possessive(alike_on)} `{short(pick['name'], among)}` is rank {sender}'s {dt(src['dtype'])} bytes" \
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
    sentence = f"{head}: {f.bucket_how}, {f.bucket_what}{f.tail}"
    return Diagnosis("reinterpreted", sentence, f.first_step, alike_on, pick["name"], call, f.evidence())


def when_mispaired(f: PartFacts) -> bool:
    """a rank issued an extra coalesced bucket (FSDP buckets by dtype) that the others received into theirs"""
    return f.extra_bucket


def says_mispaired(f: PartFacts) -> Diagnosis:
    """`via` bucketed by dtype after `step` split the dtypes, rank S sent an extra fp32 bucket (…) that rank R
    received into its bf16 bucket; the rest"""
    sentence = f"{f.bucket_how}, {f.bucket_what}{f.tail}"
    tensor = f.bucket[0] if f.bucket else None
    return Diagnosis("mispaired", sentence, f.first_step, [f.receiver], tensor, f.call, f.evidence())


def says_collective_mismatch(f: PartFacts) -> Diagnosis:
    """the ranks' collectives part at group G call #N in step `S` (different collectives, dtypes, sizes, roots,
    or an extra call): rank 0: …; ranks 1-7: …; the rest"""
    div = f.div
    words = PART_WORDS.get(div.kind, "an extra call")
    how = f"the ranks' collectives part at group {div.group} call #{div.seq} in step `{div.step}` ({words})"
    sentence = f"{how}: {calls_by_group(f.calls)}{f.tail}"
    return Diagnosis("collective-mismatch", sentence, div.step, sorted(div.ranks), None, f.call, f.evidence())


def when_independent_groups(f: PartFacts, d: Diagnosis) -> bool:
    """other groups part in the same step, sharing no rank with this one"""
    return bool(f.also)


def says_independent_groups(f: PartFacts, d: Diagnosis) -> Diagnosis:
    """…; independently, on group G (ranks …): that group's parting; then what the ranks were left doing"""
    more = "".join(f"; independently, {parting(f.run, o)}" for o in f.also)
    tail = stuck_clause(where_stuck(f.run))
    d.sentence = (d.sentence[:-len(tail)] + more + tail) if tail and d.sentence.endswith(tail) \
        else d.sentence + more
    d.ranks = d.ranks + [r for o in f.also for r in sorted(o.ranks) if r not in d.ranks]
    d.evidence = pd.concat([d.evidence, ev_frame([{"step": o.step, "rank": None, "what": f"group {o.group}",
                                                   "fact": o.message} for o in f.also])], ignore_index=True)
    return d


# -- stage "tensor": the first step the wrong tensors went wrong in ----------------------------------
class TensorFacts:
    """What the tensor stage reads: faults (rank, name, status, since, ...) and the last step's bad outputs."""

    def __init__(self, run: Run, faults: pd.DataFrame, bad_out: list[dict[str, Any]]) -> None:
        self.run, self.bad_out, self.among = run, bad_out, run.names
        self.faults = faults.assign(order=faults["since"].map(run.index)).sort_values(["order", "rank"])
        self.first = self.faults.iloc[0]
        self.step = self.first["since"]
        self.at_first = self.faults[self.faults["since"] == self.step]  # the faults of the first step

    def rows(self) -> list[dict[str, Any]]:
        """The evidence: each fault (at most 50), then each bad output."""
        ev = [{"step": f.since, "rank": f.rank, "what": f.name, "fact": f"{f.status} since `{f.since}`: {f.detail}"}
              for f in self.faults.itertuples(index=False)][:50]
        return ev + [{"step": b["step"], "rank": b["rank"], "what": b["name"], "fact": b["how"]} for b in self.bad_out]

    @cached_property
    def out(self) -> str:
        return outputs_clause(self.bad_out)

    @cached_property
    def never(self) -> pd.DataFrame:
        """Tensors never written since materialisation (poison, or NaN computed from poison)."""
        a = self.at_first
        return a[(a["status"] == "poison") | (a["since_status"] == "poison")]

    @cached_property
    def ref(self) -> pd.DataFrame:
        """Tensors that depart from their reference value."""
        return self.at_first[self.at_first["status"] == "reference"]

    @cached_property
    def synced(self) -> pd.DataFrame:
        """A weight sync's loaded names against the trainer's exported tensors (only when a reference departs)."""
        return weightsync.match_matrix(self.run, self.step) if len(self.ref) \
            else pd.DataFrame(columns=weightsync.MATCH_COLUMNS)

    def hits(self, status: str) -> list[str]:
        return list(self.synced[self.synced["status"] == status]["finding"])

    @cached_property
    def ref_rows(self) -> pd.DataFrame:
        """The first departing tensor's rows on every rank."""
        t = self.run.at(self.run.tensors, self.step)
        return t[t["name"] == self.ref["name"].iloc[0]]

    @property
    def agreed(self) -> bool:
        """Every rank holds the same bytes of it."""
        g, all_ranks = self.ref_rows, self.run.ranks
        return set(g["rank"]) == set(all_ranks) and g["fingerprint"].nunique() == 1 and len(all_ranks) > 1

    @property
    def worst(self) -> float:
        return max((float(x) for x in self.ref_rows["ref_diff"] if is_number(x) and float(x) == float(x)),
                   default=float("nan"))

    @cached_property
    def split(self) -> pd.DataFrame:
        """Tensors whose run of wrong steps began with a dtype split."""
        return self.at_first[self.at_first["since_status"] == "dtype"]

    @cached_property
    def tie(self) -> tuple[str, str] | None:
        """(name, partner): a never-written tensor that was one tensor with ``partner`` the step before."""
        return broken_tie(self.run, self.step, list(dict.fromkeys(self.never["name"]))) if len(self.never) else None


def when_never_written(f: TensorFacts) -> bool:
    """a tensor holds memory never written since materialisation (poison, or NaN computed from it)"""
    return len(f.never) > 0


def says_never_written(f: TensorFacts) -> Diagnosis:
    """`t` on rank R was never written after materialisation at step `S` (or: was real (not meta) before step
    `S` and was replaced there by memory never written since): `forward` read the unwritten bytes; output …;
    every rank holds the same garbage, so a cross-rank check sees nothing"""
    run, never, step, among = f.run, f.never, f.step, f.among
    all_ranks = run.ranks
    names = list(dict.fromkeys(never["name"]))
    ranks = sorted(set(never["rank"]))
    read = [s for s in run.steps[run.index(step):] if len(run.at(run.outputs, s))]
    agree = set(ranks) == set(all_ranks) and len(all_ranks) > 1
    real = real_before(run, step, names, ranks)
    was = "was" if len(names) == 1 else "were"
    sentence = (f"{named(names, among)} on {ranks_words(ranks)} {was} real (not meta) before step `{step}` "
                f"({real}) and {was} replaced there by memory never written since"
                if real else
                f"{named(names, among)} on {ranks_words(ranks)} {was} never written after materialisation at "
                f"step `{step}`")
    kept = never[never["status"] == "nan"]
    sentence = (sentence
                + (f": `{read[0]}` read the unwritten bytes" if read else ": still unwritten at the last step")
                + (f"; in-place updates kept it NaN through step `{kept['last'].iloc[0]}`" if len(kept) else "")
                + f.out + ("; every rank holds the same garbage, so a cross-rank check sees nothing"
                           if agree else ""))
    return Diagnosis("never-written", sentence, step, ranks, names[0], None, ev_frame(f.rows()))


def _synced(f: TensorFacts, status: str, mechanism: str, what: str) -> Diagnosis:
    """A weight sync loaded names with the wrong content: say whose tensor each one now holds."""
    hits, ref, step = f.hits(status), f.ref, f.step
    ranks = sorted(set(ref["rank"]))
    sentence = f"{hits[0]}: {len(hits)} loaded name(s) {what} from step `{step}` on, and nothing raised" + f.out
    via = weightsync.sliced_with(f.run, step) if status == "mislabel" else None
    if via is not None:
        ws = via["workers"]
        who = (f"worker {ws[0]} sliced trainer rank {ws[0]}'s buffer" if len(ws) == 1 else
               f"{ranks_words(ws).replace('ranks', 'workers', 1)} sliced their own trainer ranks' buffers")
        sentence = f"{who} with rank {via['rank']}'s metadata (names and offsets): {sentence}"
    ev = [{"step": step, "rank": None, "what": status, "fact": m} for m in hits[:20]] + f.rows()
    return Diagnosis(mechanism, sentence, step, ranks, str(ref["name"].iloc[0]), None, ev_frame(ev))


def when_mislabeled(f: TensorFacts) -> bool:
    """a weight sync loaded names holding another exported tensor's bytes"""
    return bool(f.hits("mislabel"))


def says_mislabeled(f: TensorFacts) -> Diagnosis:
    """(worker W sliced trainer rank W's buffer with rank R's metadata (names and offsets):) `a` holds `b`: N
    loaded name(s) hold another exported tensor's bytes from step `S` on, and nothing raised"""
    return _synced(f, "mislabel", "mislabeled", "hold another exported tensor's bytes")


def when_lossy_cast(f: TensorFacts) -> bool:
    """a weight sync loaded names holding the trainer's values rounded by its cast"""
    return bool(f.hits("cast"))


def says_lossy_cast(f: TensorFacts) -> Diagnosis:
    """`a` …: N loaded name(s) hold the trainer's values rounded by the sync's cast from step `S` on, and nothing
    raised"""
    return _synced(f, "cast", "lossy-cast", "hold the trainer's values rounded by the sync's cast")


def when_agreed_wrong(f: TensorFacts) -> bool:
    """a tensor departs from its reference value with the same bytes on every rank"""
    return len(f.ref) > 0 and f.agreed


def says_agreed_wrong(f: TensorFacts) -> Diagnosis:
    """every rank holds the same wrong `t` from step `S` (departs from its reference value by X): a cross-rank
    comparison sees nothing"""
    names, ranks = list(dict.fromkeys(f.ref["name"])), sorted(set(f.ref["rank"]))
    sentence = (f"every rank holds the same wrong {named(names, f.among)} from step `{f.step}` (departs from "
                f"its reference value by {fmt(f.worst)}): a cross-rank comparison sees nothing" + f.out)
    return Diagnosis("agreed-wrong", sentence, f.step, ranks, names[0], None, ev_frame(f.rows()))


def when_wrong_value(f: TensorFacts) -> bool:
    """a tensor departs from its reference value"""
    return len(f.ref) > 0


def says_wrong_value(f: TensorFacts) -> Diagnosis:
    """`t` on rank R departs from its reference value (by X) from step `S`"""
    names, ranks = list(dict.fromkeys(f.ref["name"])), sorted(set(f.ref["rank"]))
    sentence = (f"{named(names, f.among)} on {ranks_words(ranks)} departs from its reference value "
                f"(by {fmt(f.worst)}) from step `{f.step}`" + f.out)
    return Diagnosis("wrong-value", sentence, f.step, ranks, names[0], None, ev_frame(f.rows()))


def when_dtype_split(f: TensorFacts) -> bool:
    """a tensor's dtype split across ranks and stayed split"""
    return len(f.split) > 0


def says_dtype_split(f: TensorFacts) -> Diagnosis:
    """`t` split by dtype at step `S` (fp32 on rank 0, bf16 on rank 1) and stayed split"""
    names = list(dict.fromkeys(f.split["name"]))
    t = f.run.at(f.run.tensors, f.step)
    g = t[t["name"] == names[0]]
    per = ", ".join(f"{dt(d)} on rank {int(r)}" for r, d in zip(g["rank"], g["dtype"]))
    sentence = f"{named(names, f.among)} split by dtype at step `{f.step}` ({per}) and stayed split" + f.out
    return Diagnosis("dtype-split", sentence, f.step, sorted(set(f.split["rank"])), names[0], None, ev_frame(f.rows()))


def says_diverged(f: TensorFacts) -> Diagnosis:
    """`t` on rank R <status> from step `S` on (detail)"""
    names, ranks = list(dict.fromkeys(f.at_first["name"])), sorted(set(f.at_first["rank"]))
    sentence = (f"{named(names, f.among)} on {ranks_words(ranks)} {f.first['status']} from step `{f.step}` on "
                f"({f.first['detail']})" + f.out)
    return Diagnosis("diverged", sentence, f.step, ranks, names[0], None, ev_frame(f.rows()))


def when_tie_broken(f: TensorFacts, d: Diagnosis) -> bool:
    """the never-written tensor was one tensor with another (tied) the step before and is its own after"""
    return d.mechanism == "never-written" and f.tie is not None


def says_tie_broken(f: TensorFacts, d: Diagnosis) -> Diagnosis:
    """…; `a` and `b` were one tensor (tied) until step `S` and are two after it: the tie broke there, so what
    was written into `b` never reached `a` (tie them again after materialising, …)"""
    (name, partner), step, among = f.tie, f.step, f.among
    d.sentence += (f"; `{short(name, among)}` and `{short(partner, among)}` were one tensor (tied) until step "
                   f"`{step}` and are two after it: the tie broke there, so what was written into "
                   f"`{short(partner, among)}` never reached `{short(name, among)}` (tie them again after "
                   "materialising, e.g. `tie_weights()` after `to_empty`)")
    d.evidence = pd.concat([ev_frame([{"step": step, "rank": None, "what": "tie broken",
                                       "fact": f"{name} shared {partner}'s tensor before step `{step}`, holds its own "
                                               "after"}]), d.evidence], ignore_index=True)
    return d


# -- the order ---------------------------------------------------------------------------------------
RULES: tuple[Rule, ...] = (
    Rule("story", "permuted", when_permuted, says_permuted),
    Rule("story", "fault-before-parting", when_fault_before_parting, says_fault_before_parting),
    Rule("story", "parted", when_parted, says_parted),
    Rule("story", "rank-died", when_died, says_died),
    Rule("story", "hang", when_hung, says_hung),
    Rule("story", "tensors-wrong", when_tensors_wrong, says_tensors_wrong),
    Rule("story", "outputs-only", when_outputs_only, says_outputs_only),
    Rule("story", "clean-so-far", when_clean_so_far, says_clean_so_far),
    Rule("story", "clean", always, says_clean),
    Rule("parting", "rank-missing", when_rank_missing, says_rank_missing),
    Rule("parting", "reinterpreted", when_reinterpreted, says_reinterpreted),
    Rule("parting", "mispaired", when_mispaired, says_mispaired),
    Rule("parting", "collective-mismatch", always, says_collective_mismatch),
    Rule("parting", "independent-groups", when_independent_groups, says_independent_groups, adds=True),
    Rule("tensor", "never-written", when_never_written, says_never_written),
    Rule("tensor", "mislabeled", when_mislabeled, says_mislabeled),
    Rule("tensor", "lossy-cast", when_lossy_cast, says_lossy_cast),
    Rule("tensor", "agreed-wrong", when_agreed_wrong, says_agreed_wrong),
    Rule("tensor", "wrong-value", when_wrong_value, says_wrong_value),
    Rule("tensor", "dtype-split", when_dtype_split, says_dtype_split),
    Rule("tensor", "diverged", always, says_diverged),
    Rule("tensor", "tie-broken", when_tie_broken, says_tie_broken, adds=True),
    Rule("exception", "raised-alone", when_raised_alone, says_raised_alone),
    Rule("exception", "raised-independently", when_raised_independently, says_raised_independently),
    Rule("exception", "raised-leads", when_raised_leads, says_raised_leads),
    Rule("exception", "raised-first", when_raised_first, says_raised_first),
    Rule("exception", "story-stands", always, says_story_stands),
    Rule("exception", "exception-unnamed", when_exception_unnamed, says_exception_unnamed, adds=True),
)


def rules() -> pd.DataFrame:
    """The rules in the order they are tried: stage, name, whether it adds to the story, when it fires, what it
    says."""
    return pd.DataFrame([{"stage": r.stage, "rule": r.name, "adds": r.adds, "fires when": r.fires_when,
                          "says": r.tells} for r in RULES], columns=["stage", "rule", "adds", "fires when", "says"])
