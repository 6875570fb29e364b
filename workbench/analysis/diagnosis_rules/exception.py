"""Stage ``exception``: how a rank's exception joins the state's story.

Alone, when the state reads clean; independently, raised on ranks outside a group whose
collectives part in the same step; as the cause of that parting, raised on its ranks; before the
state went wrong, or in that step with no collective to blame; else the story stands. Then each
exception the story's clauses have not named yet.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import pandas as pd

from workbench.analysis import cause
from workbench.analysis.diagnosis_rules import parting
from workbench.analysis.diagnosis_rules.rule import Rule, always, walk
from workbench.analysis.diagnosis_run import Run, parted_members
from workbench.analysis.diagnosis_type import Diagnosis
from workbench.analysis.diagnosis_words import from_error, lead, said, told
from workbench.analysis.rankgroups import ranks_words

OUTCOMES = ("rank-died", "hang")  # stories about ranks, which already name who raised
# stories read from the ledger: the parting stage's, each named for the rule that tells it
PARTED = frozenset(r.name for r in parting.RULES if not r.adds)


class ExceptionFacts:
    """What the exception stage reads: the run, the state's story, the first exception against it."""

    def __init__(self, run: Run, story: Diagnosis) -> None:
        self.run, self.story = run, story

    @property
    def error(self) -> Any:
        """The first step's first ``error`` event, or None."""
        return self.run.first_error

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


def when_raised_alone(f: ExceptionFacts) -> bool:
    """a rank raised and the state reads clean"""
    return f.error is not None and f.story.clean


def says_raised_alone(f: ExceptionFacts) -> Diagnosis:
    """rank R raised E in step `S`: message (the others that raised then, by rank)"""
    return from_error(f.run, f.error.step)


def _parted_same_step(f: ExceptionFacts) -> bool:
    return f.error is not None and f.same_step and f.story.mechanism in PARTED and bool(f.raised)


def when_raised_independently(f: ExceptionFacts) -> bool:
    """ranks raised in the step whose collectives part, on ranks outside the parted group: neither failure
    explains the other"""
    if not _parted_same_step(f):
        return False
    members = parted_members(f.run, f.story.call)
    return bool(members) and not f.raisers & set(members)


def says_raised_independently(f: ExceptionFacts) -> Diagnosis:
    """the raising ranks' exceptions (a cause); independently, on group G (ranks …): the parting's story (a
    symptom)"""
    d = f.story
    group = (d.call or {}).get("group")
    d.lead(*told(f.raised, d.step),
           said(f"; independently, on group {group} ({ranks_words(parted_members(f.run, d.call))}): "))
    d.ranks = sorted(f.raisers) + [r for r in d.ranks if r not in f.raisers]
    return d


def when_raised_leads(f: ExceptionFacts) -> bool:
    """ranks raised in the step whose collectives part: the exception is the cause, the parting what it left"""
    return _parted_same_step(f)


def says_raised_leads(f: ExceptionFacts) -> Diagnosis:
    """rank R raised E in step `S`: message; it left rank Q waiting: the parting's story"""
    d = f.story
    waiting = [s["rank"] for s in f.run.stuck if s["rank"] not in f.raisers]
    d.lead(*lead(f.raised, d.step, waiting), said(": "))
    d.ranks = sorted(f.raisers) + [r for r in d.ranks if r not in f.raisers]
    return d


def when_raised_first(f: ExceptionFacts) -> bool:
    """a rank raised before the state went wrong (a check refusing a stream, a failed load), or in that step
    without a collective to blame"""
    if f.error is None:
        return False
    at, then_ = f.run.index(f.error.step), f.run.index(f.story.step)
    return at < then_ or (at == then_ and f.story.call is None and f.story.mechanism not in OUTCOMES)


def says_raised_first(f: ExceptionFacts) -> Diagnosis:
    """the exception's story; later, in step `S` (or: in the same step; or, a story of no step such as "not looked":
    only "; "): the state's story"""
    d = f.story
    e = from_error(f.run, f.error.step)
    joint = "; " if d.step is None else "; in the same step: " if f.same_step else f"; later, in step `{d.step}`: "
    e.add(said(joint), *d.clauses)
    e.evidence = pd.concat([e.evidence, d.evidence], ignore_index=True)
    return e


def when_raised_after_unseen(f: ExceptionFacts) -> bool:
    """a rank raised after the only point that saw the tensors, the one right after their materialisation: the
    job may have written them before it raised, so the raise is what is known"""
    return f.error is not None and f.story.mechanism == "unwritten-unseen"


def says_raised_after_unseen(f: ExceptionFacts) -> Diagnosis:
    """rank R raised E at file:line in step `S`: message; before it: the tensors as that one point saw them"""
    d = f.story
    raised = cause.causes(f.run.events, f.error.step)
    d.lead(*told(raised, f.error.step), said("; before it: "))
    first = sorted({int(e["rank"]) for e in raised})
    d.ranks = first + [r for r in d.ranks if r not in first]
    return d


def says_story_stands(f: ExceptionFacts) -> Diagnosis:
    """the state's story as it is (no exception, a later one, or one a rank's death or hang already names)"""
    return f.story


def _unnamed(f: ExceptionFacts, d: Diagnosis) -> list[tuple[str, list[dict[str, Any]]]]:
    """(step, exceptions) the sentence does not name, per step with an error, in the order the steps first come."""
    ev = f.run.events
    if not len(ev) or "kind" not in ev.columns:
        return []
    named = d.raisers  # what the story's clauses already name, never what its words happen to read like
    out = []
    for step in dict.fromkeys(ev[ev["kind"] == "error"]["step"]):
        missing = [e for e in cause.causes(ev, step) if (int(e["rank"]), str(e["error"])) not in named]
        if missing:
            out.append((step, missing))
    return out


def when_exception_unnamed(f: ExceptionFacts, d: Diagnosis) -> bool:
    """a rank's exception is not named yet (a later step's, a rank outside the parted group)"""
    return bool(_unnamed(f, d))


def says_exception_unnamed(f: ExceptionFacts, d: Diagnosis) -> Diagnosis:
    """…; rank R raised E at file:line in step `S`: message (one clause per distinct exception)"""
    for step, missing in _unnamed(f, d):
        d.add(said("; "), *told(missing, step))
    return d


# -- the order: tried top to bottom ------------------------------------------------------------------
RULES: tuple[Rule, ...] = (
    Rule("exception", "raised-alone", when_raised_alone, says_raised_alone),
    Rule("exception", "raised-independently", when_raised_independently, says_raised_independently),
    Rule("exception", "raised-leads", when_raised_leads, says_raised_leads),
    Rule("exception", "raised-first", when_raised_first, says_raised_first),
    Rule("exception", "raised-after-unseen", when_raised_after_unseen, says_raised_after_unseen),
    Rule("exception", "story-stands", always, says_story_stands),
    Rule("exception", "exception-unnamed", when_exception_unnamed, says_exception_unnamed, adds=True),
)


def tell(facts: Any) -> Diagnosis:
    """This stage's story: its rules walked in order."""
    return walk(RULES, facts)
