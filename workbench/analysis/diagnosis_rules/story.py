"""Stage ``story``: what the run's state says, in causal order.

A weight stream out of its plan; a tensor wrong on its own terms before the collectives parted;
the collectives parting (stage ``parting``); a rank that died, then one that hung, with the ledgers
agreeing; tensors still wrong at the last step (stage ``tensor``); outputs departing while every
probed tensor agrees; else clean (so far, when fewer steps ran than planned).
"""

from __future__ import annotations

import dataclasses
import re
from functools import cached_property
from typing import Any

import pandas as pd

from workbench.analysis import cause, collectives
from workbench.analysis.diagnosis_rules import parting, tensor
from workbench.analysis.diagnosis_rules.rule import Rule, always, outcome_rows, then, walk
from workbench.analysis.diagnosis_run import Run, first_faults, last_call, persistent_faults
from workbench.analysis.diagnosis_type import Clause, Diagnosis
from workbench.analysis.diagnosis_words import (
    ev_frame,
    floor_clause,
    from_error,
    outputs_clause,
    said,
    short,
)
from workbench.analysis.rankgroups import ranks_words
from workbench.analysis.weightsync_order import first_split
from workbench.errors import LOST


class RunFacts:
    """What the story stage reads from a run (each fact computed once, when a rule first asks for it)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    @cached_property
    def div(self) -> collectives.Divergence | None:
        """The first ledger call on which the ranks disagree."""
        return self.run.divergences[0] if self.run.divergences else None

    @cached_property
    def stream_split(self) -> dict[str, Any] | None:
        """Where a packed weight stream's order parts from the receiver's plan (the ranks' notes)."""
        return first_split(self.run.notes)

    @cached_property
    def early(self) -> pd.DataFrame:
        """Tensors wrong on their own terms before the collectives parted."""
        return first_faults(self.run, before=self.div.step)

    @property
    def stuck(self) -> list[dict[str, Any]]:
        return self.run.stuck

    @cached_property
    def dead(self) -> list[dict[str, Any]]:
        return [s for s in self.stuck if s["how"] in LOST]

    @property
    def bad_out(self) -> list[dict[str, Any]]:
        return self.run.bad_outputs

    @cached_property
    def faults(self) -> pd.DataFrame:
        """Tensors wrong at the last step; those holding per-rank values by design ("tensor" probes) may
        differ when the outputs agree."""
        faults, run = persistent_faults(self.run), self.run
        if len(faults) and not self.bad_out and len(run.outputs):
            kinds = run.kinds
            faults = faults[~((faults["status"] == "differs") & (faults["name"].map(kinds) == "tensor"))]
        return faults


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
    clauses = [said(f"the receiver's plan and the sender's stream part at index {sp['index']} of stage {sp['stage']}"
                    f"{types}: the plan lists `{short(str(sp['planned']))}` there, the stream carries "
                    f"`{short(str(sp['streamed']))}`, so {sp['wrong']} of {sp['names']} planned names load other "
                    "tensors' bytes")]
    later = run.steps[run.index(step):] if step is not None else []
    caught = next((st for st in later if cause.causes(run.events, st)), None)  # an exception, not a collective's
    if caught is not None:
        clauses += [said("; "), *from_error(run, caught).clauses]  # a check that caught it: loud, yet the same cause
    else:
        clauses.append(said(" and nothing raised"))
    ev = [{"step": step, "rank": None, "what": "plan vs stream",
           "fact": f"index {sp['index']}: plan {sp['planned']!r}, stream {sp['streamed']!r}"}]
    d = Diagnosis("permuted", clauses, step, [], sp["planned"], None, ev_frame(ev))
    if f.div is not None and run.index(f.div.step) >= run.index(d.step):
        return then(d, f.div.step, parting.tell(parting.PartFacts(run, f.div)))
    return d.add(outputs_clause(f.bad_out))


def when_fault_before_parting(f: RunFacts) -> bool:
    """the collectives part, and a tensor was already wrong on its own terms (never written, NaN, off its
    reference) in an earlier step"""
    return f.div is not None and len(f.early) > 0


def says_fault_before_parting(f: RunFacts) -> Diagnosis:
    """the tensor stage's story of the early fault; later, in step `S`: the parting stage's story"""
    told = tensor.tell(tensor.TensorFacts(f.run, f.early, []))
    return then(told, f.div.step, parting.tell(parting.PartFacts(f.run, f.div)))


def when_parted(f: RunFacts) -> bool:
    """the ranks' collectives ledgers disagree on a call"""
    return f.div is not None


def says_parted(f: RunFacts) -> Diagnosis:
    """the parting stage's story"""
    return parting.tell(parting.PartFacts(f.run, f.div))


def when_died(f: RunFacts) -> bool:
    """a rank died or was stopped, with the ledgers agreeing"""
    return bool(f.dead)


def says_died(f: RunFacts) -> Diagnosis:
    """rank R's engine died in step `S` (its last call: …); rank Q hung in …"""
    s = f.dead[0]
    last = last_call(f.run, s["rank"])
    lost = "died" if s["how"] == "died" else "was stopped (SIGSTOP or Ctrl-Z), not dead,"
    others = [x for x in f.stuck if x is not s]
    head = (f"rank {s['rank']}'s engine {lost} in step `{s['step']}`"
            + (f" (its last call: {collectives.describe(last)}, {last.get('state')})" if last else ""))
    clauses = [Clause(head, "stuck", (s,)), Clause("".join(f"; rank {x['rank']} {x['how']}" for x in others),
                                                  "stuck", tuple(others))]
    return Diagnosis("rank-died", clauses, s["step"], [s["rank"]], None, last, ev_frame(outcome_rows(f.stuck)))


def when_hung(f: RunFacts) -> bool:
    """a rank timed out or hung, with the ledgers agreeing"""
    return bool(f.stuck)


def says_hung(f: RunFacts) -> Diagnosis:
    """step `S` did not finish: rank R hung in …; the ranks' ledgers agree call for call, so no collective was
    mispaired"""
    stuck = f.stuck
    s = stuck[0]
    clauses = [Clause(f"step `{s['step']}` did not finish: " + "; ".join(f"rank {x['rank']} {x['how']}" for x in stuck),
                      "stuck", tuple(stuck)),
               said("; the ranks' ledgers agree call for call, so no collective was mispaired")]
    return Diagnosis("hang", clauses, s["step"], [x["rank"] for x in stuck], None, s.get("call"),
                     ev_frame(outcome_rows(stuck)))


def when_tensors_wrong(f: RunFacts) -> bool:
    """tensors are still wrong at the last step they were probed in"""
    return len(f.faults) > 0


def says_tensors_wrong(f: RunFacts) -> Diagnosis:
    """the tensor stage's story, from the step they went wrong in and stayed wrong from; where some ranks alone
    took the point just before: what they did there is where the ranks part"""
    d = tensor.tell(tensor.TensorFacts(f.run, f.faults, f.bad_out))
    return dataclasses.replace(d, clauses=[*d.clauses, *_alone_before(f.run, d.step)])


def _alone_before(run: Run, step: str | None) -> list:
    """The step before ``step`` where fewer ranks took a point than at ``step`` (a job's rank 0 alone loading a state
    dict: the reader pairs the points by name, ``postmortem/shards.py``)."""
    steps = list(run.steps)
    if step not in steps or steps.index(step) == 0 or not len(run.tensors):
        return []
    before = steps[steps.index(step) - 1]
    took, then = set(run.at(run.tensors, before)["rank"]), set(run.at(run.tensors, step)["rank"])
    if not took or not took < then:
        return []
    return [said(f"; just before, {ranks_words(sorted(took))} alone took the point `{before}` "
                 f"({ranks_words(sorted(then - took))} never did): the ranks part there")]


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
    clauses = [said(f"outputs depart at step `{bad_out[0]['step']}`"), outputs_clause(bad_out),
               said(f"{where}, while every probed tensor agrees across ranks and with its reference: the cause is "
                    "outside what was probed")]
    return Diagnosis("outputs-only", clauses, bad_out[0]["step"], ranks, None, None,
                     ev_frame([{"step": b["step"], "rank": b["rank"], "what": b["name"], "fact": b["how"]}
                               for b in bad_out]))


def _planned(run: Run) -> int:
    return len(run.manifest.get("steps") or run.steps)


_FLAT = re.compile(r"(?:^|\.)group\d+\.param\d+$")  # an optimizer's tensor no module owns (hooks' fallback names)


def _model_rows(run: Run) -> int:
    """How many tensors the points probed that belong to a model (not an optimizer's flat partitions)."""
    t = run.tensors
    if not len(t) or "name" not in t:
        return 0
    return int((~t["name"].astype(str).str.contains(_FLAT)).sum())


def when_not_looked(f: RunFacts) -> bool:
    """a captured job (``workbench job``) where nothing went wrong that the capture saw, but it probed no tensor of
    a model (no point, or only an optimizer's flat partitions)"""
    return isinstance(f.run.manifest.get("job"), dict) and _model_rows(f.run) == 0


def says_not_looked(f: RunFacts) -> Diagnosis:
    """not looked: the capture probed no tensor at all (or only the optimizer's K flat tensors no module owns), so
    nothing says the model's state is right"""
    run = f.run
    flat = len(set(run.tensors["name"])) if len(run.tensors) and "name" in run.tensors else 0
    what = (f"only the optimizer's {flat} flat tensor(s) no module owns, never the model's parameters or buffers"
            if flat else "no tensor at all")
    return Diagnosis("not-looked", [said(f"not looked: the capture probed {what}, "
                                         "so nothing says the model's state is right (a manual "
                                         "`cap.point(..., model=model)` probes it)"), floor_clause(run),
                                    *_unfollowed(run)], None)


def when_clean_so_far(f: RunFacts) -> bool:
    """fewer steps ran than the run plans"""
    return len(f.run.steps) < _planned(f.run)


def says_clean_so_far(f: RunFacts) -> Diagnosis:
    """clean so far: K of N steps ran on every rank, the ranks agree and no detector fired on the latest state"""
    run = f.run
    return Diagnosis("clean", [said(f"clean so far: {len(run.steps)} of {_planned(run)} steps ran on every rank, the "
                                    "ranks agree and no detector fired on the latest state"), floor_clause(run),
                            *_outlived(run)], None)


def says_clean(f: RunFacts) -> Diagnosis:
    """clean: all N step(s) ran on every rank, the ranks agree and no detector fired on the final state; a job whose
    automatic step points stopped before its last optimizer step: where the view ended"""
    run = f.run
    return Diagnosis("clean", [said(f"clean: all {len(run.steps)} step(s) ran on every rank, the ranks agree and no "
                                    "detector fired on the final state"), floor_clause(run), *_unfollowed(run),
                            *_outlived(run)], None)


def _unfollowed(run: Run) -> list:
    """A captured job that ran optimizer steps after its last step point: what the capture did not see."""
    seen = ((run.manifest.get("job") or {}).get("followed")) or {}
    ran, last = int(seen.get("optimizer_steps") or 0), int(seen.get("last_step_point") or 0)
    if not last or ran <= last:
        return []
    return [said(f"; the capture's last step point is after optimizer step {last} of the {ran} the job ran, so "
                 f"the steps after it are not seen (`workbench job --every N`: a point every N-th step)")]


def _references(n: object) -> str:
    return f"{n} reference" if n == 1 else f"{n} references"


def _outlived(run: Run) -> list:
    """A job whose world group some object still held after its ``destroy_process_group`` (``job/teardown.py``):
    why a run that reads clean may still exit 1."""
    held = ((run.manifest.get("job") or {}).get("group_outlived")) or {}
    if not held:
        return []
    first = min(held, key=int)
    ranks = ",".join(sorted(held, key=int))
    how = ("gloo's worker threads run on into interpreter exit, where one may abort the rank after its last line "
           "('terminate called without an active exception')" if run.manifest.get("backend") == "gloo" else
           "its backend's threads run on into interpreter exit")
    return [said(f"; on rank{'s' if len(held) > 1 else ''} {ranks} the world group outlived the job's "
                 f"`destroy_process_group` (rank {first}: {_references(held[first].get('refs'))}, "
                 f"{held[first].get('holders')}), so {how}: a job that exited 1 there failed at its teardown, "
                 "not in its training")]


# -- the order: tried top to bottom ------------------------------------------------------------------
RULES: tuple[Rule, ...] = (
    Rule("story", "permuted", when_permuted, says_permuted),
    Rule("story", "fault-before-parting", when_fault_before_parting, says_fault_before_parting),
    Rule("story", "parted", when_parted, says_parted),
    Rule("story", "rank-died", when_died, says_died),
    Rule("story", "hang", when_hung, says_hung),
    Rule("story", "tensors-wrong", when_tensors_wrong, says_tensors_wrong),
    Rule("story", "outputs-only", when_outputs_only, says_outputs_only),
    Rule("story", "not-looked", when_not_looked, says_not_looked),
    Rule("story", "clean-so-far", when_clean_so_far, says_clean_so_far),
    Rule("story", "clean", always, says_clean),
)


def tell(facts: Any) -> Diagnosis:
    """This stage's story: its rules walked in order."""
    return walk(RULES, facts)
