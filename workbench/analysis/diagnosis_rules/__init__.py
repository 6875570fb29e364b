"""The diagnosis's rules, in the order they are tried: which finding tells the story, and what it says.

Four stages, one module each, each holding its ``RULES`` in order. In a stage, the first rule
whose ``when`` holds tells the story (its ``says``); then each rule of the stage that *adds* and
whose ``when`` holds adds its clause to that story (``rule.walk``).

- ``story``: the run's state, in causal order: a weight stream out of its plan, a tensor wrong before
  the collectives parted, the collectives parting, a rank that died or hung, tensors still wrong at
  the last step, outputs departing while every tensor agrees, else clean;
- ``parting``: how the first divergent collective reads (a rank that never issued it, a receiving
  rank's bytes reinterpreted, an extra bucket, different calls), then each group that parted on its own;
- ``tensor``: how the first wrong tensors read (never written, mislabeled or rounded by a weight
  sync, one wrong value on every rank, another value, a dtype split, plain divergence), then a tie that
  broke there;
- ``exception``: how a rank's exception joins the story (alone, independently, as the cause of the
  parting, before it), then each exception the story's clauses have not named yet.

A new finding is a rule put in its place in its stage's ``RULES``: a ``when`` and a ``says`` (an
adding rule's take the story so far as a second argument), each reading the stage's facts
(``RunFacts``, ``PartFacts``, ``TensorFacts``, ``ExceptionFacts``: every fact computed once, when a
rule first asks for it; the facts several stages share live on the ``Run``). A ``says`` builds its
``Diagnosis`` from clauses (``workbench.analysis.diagnosis_words``); an adding rule reads the story's
clauses, never its sentence. ``rules()`` is the whole list as a table.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from workbench.analysis.diagnosis_rules import exception, parting, rule, story, tensor
from workbench.analysis.diagnosis_rules.rule import Rule
from workbench.analysis.diagnosis_run import Run
from workbench.analysis.diagnosis_type import Diagnosis

STAGES = {"story": story, "parting": parting, "tensor": tensor, "exception": exception}


def all_rules() -> tuple[Rule, ...]:
    """Every stage's rules, stage by stage, each in the order it is tried."""
    return tuple(r for m in STAGES.values() for r in m.RULES)


RULES = all_rules()


def first(stage: str, facts: Any) -> Rule:
    """The rule that tells ``stage``'s story from ``facts`` (that stage's facts)."""
    return rule.first(STAGES[stage].RULES, facts)


def diagnose_run(run: Run) -> Diagnosis:
    """The story the run's state tells, then how its ranks' exceptions join it."""
    told = story.tell(story.RunFacts(run))
    return exception.tell(exception.ExceptionFacts(run, told))


def rules() -> pd.DataFrame:
    """The rules in the order they are tried: stage, name, whether it adds to the story, when it fires, what it
    says."""
    return pd.DataFrame([{"stage": r.stage, "rule": r.name, "adds": r.adds, "fires when": r.fires_when,
                          "says": r.tells} for r in all_rules()],
                        columns=["stage", "rule", "adds", "fires when", "says"])
