"""A rule of the diagnosis, and the walk of one stage's rules.

A stage's rules are tried in order: the first whose ``when(facts)`` holds tells the story
(``says(facts)``); then each rule that ``adds`` and whose ``when(facts, story)`` holds adds its
clause (``says(facts, story)``). Every stage ends with a rule that always fires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from workbench.analysis.diagnosis_type import Diagnosis
from workbench.analysis.diagnosis_words import said


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


def first(rules: Sequence[Rule], facts: Any) -> Rule:
    """The rule that tells the story from ``facts``: the first whose ``when`` holds."""
    return next(r for r in rules if not r.adds and r.when(facts))


def walk(rules: Sequence[Rule], facts: Any) -> Diagnosis:
    """The first rule that fires says the story, then each adding rule that fires adds to it."""
    d = first(rules, facts).says(facts)
    for r in rules:
        if r.adds and r.when(facts, d):
            d = r.says(facts, d)
    return d


def then(d: Diagnosis, step: str, later: Diagnosis) -> Diagnosis:
    """``d``, then ``later`` (what went wrong next, in ``step``) as its second part."""
    d.add(said(f"; later, in step `{step}`: "), *later.clauses)
    d.call = later.call
    d.evidence = pd.concat([d.evidence, later.evidence], ignore_index=True)
    return d


def outcome_rows(stuck: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evidence rows: who timed out, hung or died, and how."""
    return [{"step": x["step"], "rank": x["rank"], "what": "outcome", "fact": x["how"]} for x in stuck]
