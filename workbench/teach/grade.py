"""The grader: run the learner's step on the live ranks and answer from the workbench's own diagnosis.

Three answers. *Fixed*: every rank ran every step, the diagnosis is clean and the exercise's own check
(outputs agree, the right bytes under the right names) passes. *Fixed the symptom only*: the thing the
notebook showed going wrong is gone (the NaN, the hang, the wrong routing) while the diagnosis still
finds the cause, as ``recompute-after-wrap`` does in notebook 01. *Not fixed*: the symptom is still
there; the sentence says what is wrong, from ``s.diagnose()``.
"""

from __future__ import annotations

import html
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from workbench.analysis import diagnosis as diag
from workbench.analysis import findings, floor
from workbench.errors import LOST, WorkbenchError
from workbench.teach.exercises import FIXED, NOT_FIXED, SLOT_STEP, SYMPTOM_ONLY, Exercise, get, warm


@dataclass
class Verdict:
    """What the grader found: ``status`` (fixed / not fixed / fixed the symptom only) and why."""

    exercise: str
    status: str
    sentence: str
    diagnosis: diag.Diagnosis
    problems: list[str] = field(default_factory=list)
    session: Any = None  # the graded run: s.history, s.diagnose(), wb.viz views

    @property
    def fixed(self) -> bool:
        return self.status == FIXED

    def __str__(self) -> str:
        return f"exercise {self.exercise}: {self.status.upper()}: {self.sentence}"

    __repr__ = __str__

    def _repr_markdown_(self) -> str:
        mark = {FIXED: "✅", SYMPTOM_ONLY: "🟡", NOT_FIXED: "❌"}[self.status]
        return f"{mark} **exercise {self.exercise}: {self.status}.** {html.escape(self.sentence)}"


# -- the symptom each notebook shows, read from a finished session's tables ------------------------------
def _last_tensors(s: Any) -> pd.DataFrame:
    h = s.history
    if h.empty:
        return h
    return h.sort_values("step_index").groupby(["rank", "name"], as_index=False).last()


def _last_outputs(s: Any, name: str) -> pd.DataFrame:
    out = s.outputs
    if out.empty or "name" not in out:
        return pd.DataFrame()
    out = out[out["name"].astype(str).str.fullmatch(name)]
    return out.sort_values("step_index").groupby(["rank", "name"], as_index=False).last()


def _ranks(s: Any) -> int:
    return s.cluster.world_size


def _inv_freq_ok(s: Any) -> bool:
    last = _last_tensors(s)
    rows = findings.status(last[last["name"].astype(str).str.endswith("rotary_emb.inv_freq")])
    return len(rows) == _ranks(s) and bool((rows["status"] == "ok").all())


def _finite_logits(s: Any) -> bool:
    out = _last_outputs(s, "logits")
    return len(out) == _ranks(s) and bool((out["nan"].astype(float) == 0).all())


def _routing_right(s: Any) -> bool:
    out = _last_outputs(s, "expert_load")
    return len(out) == _ranks(s) and bool((out["ref_max_abs_diff"].astype(float) == 0).all())


def _no_hang(s: Any) -> bool:
    return not any(f.hang is not None or {"timeout", *LOST} & f.kinds for f in s.frames) \
        and len(_last_outputs(s, "loss")) == _ranks(s)


def _own_names(s: Any) -> bool:
    notes = [n for f in s.frames for per_rank in f.notes.values() for n in per_rank]
    return s.done and not any("are not its own" in n for n in notes)


def _routing_sets(s: Any) -> bool:
    out = _last_outputs(s, r"experts\..*")
    return len(out) > 0 and bool((out["changed_fraction"].astype(float) == 0).all())


def _names_right(s: Any) -> bool:
    out = _last_outputs(s, "names_wrong")
    return len(out) > 0 and all(float(h[0]) == 0 for h in out["head"])


def _replicas_agree(s: Any) -> bool:
    last = _last_tensors(s)
    return len(last) > 0 and not (findings.status(last)["status"] == "differs").any()


SYMPTOMS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "inv_freq": (_inv_freq_ok, "`inv_freq` is right and the same on every rank"),
    "finite-logits": (_finite_logits, "the logits are finite on every rank"),
    "routing": (_routing_right, "every rank routes the tokens as the reference does"),
    "no-hang": (_no_hang, "the loop no longer hangs"),
    "own-names": (_own_names, "no worker loads bytes under a name it does not host"),
    "routing-sets": (_routing_sets, "the worker picks the trainer's experts for every token"),
    "names-right": (_names_right, "every name on the worker holds the trainer's bytes"),
    "replicas-agree": (_replicas_agree, "the replicas of every shard agree"),
}


# -- what "fixed" needs beyond a clean diagnosis -------------------------------------------------
def problems(s: Any) -> list[str]:
    """Facts a clean diagnosis could miss: outputs off their reference, ranks reporting different values,
    names holding the wrong bytes, a routing change."""
    out = s.outputs
    if out.empty:
        return ["no step produced an output"]
    last = out.sort_values("step_index").groupby(["rank", "name"], as_index=False).last()
    found = []
    if "ref_max_abs_diff" in last:
        fl = last["ref_floor"] if "ref_floor" in last else pd.Series(None, index=last.index)
        off = last[[floor.departs(d, f) for d, f in zip(last["ref_max_abs_diff"], fl)]]  # the engine's own floor
        found += [f"rank {r.rank} `{r.name}` is {float(r.ref_max_abs_diff):.3g} off its reference"
                  for r in off.itertuples(index=False)]
    for name, col in (("names_wrong", None), ("logprobs", "names_wrong")):
        rows = last[last["name"] == name]
        for r in rows.itertuples(index=False):
            n = float(r.head[0]) if col is None else float(getattr(r, col, 0) or 0)
            if n:
                found.append(f"rank {r.rank}: {int(n)} name(s) on the worker hold the wrong bytes")
    if "changed_fraction" in last:
        moved = last[pd.to_numeric(last["changed_fraction"], errors="coerce").fillna(0) > 0]
        found += [f"rank {r.rank} `{r.name}`: {float(r.changed_fraction):.0%} of tokens routed to other experts"
                  for r in moved.itertuples(index=False)]
    loss = last[last["name"] == "loss"]
    if len(loss) > 1 and loss["fingerprint"].nunique() > 1:
        found.append("the ranks report different losses: " + ", ".join(
            f"rank {r.rank} {float(r.head[0]):.6g}" for r in loss.itertuples(index=False)))
    return found


# -- grading ------------------------------------------------------------------------------------
def _slot_errors(s: Any) -> str | None:
    """The learner's step raised (not: waited in a collective until it timed out, which the diagnosis tells)."""
    for f in s.frames:
        if f.step == SLOT_STEP and f.rank_errors and f.hang is None:
            ranks = sorted(f.rank_errors)
            first = f.rank_errors[ranks[0]]
            who = "rank" if len(ranks) == 1 else "ranks"
            return f"your step raised on {who} {','.join(map(str, ranks))}: {first.removeprefix('error ')[:300]}"
    return None


def verdict(ex: Exercise, s: Any) -> Verdict:
    """Grade a finished session of ``ex`` with the learner's step in it."""
    d = s.diagnose()
    raised = _slot_errors(s)
    if raised:
        return Verdict(ex.id, NOT_FIXED, raised, d, [raised], s)
    found = problems(s)
    if d.clean and not found and s.done:
        return Verdict(ex.id, FIXED, d.sentence.removeprefix("clean: "), d, [], s)
    check, said = SYMPTOMS[ex.symptom]
    wrong = d.sentence if not d.clean else "; ".join(found)
    if check(s):
        return Verdict(ex.id, SYMPTOM_ONLY, f"{said}, but the cause is still there: {wrong}", d, found, s)
    return Verdict(ex.id, NOT_FIXED, wrong, d, found, s)


def check(where: Any, fn: Callable[[Any], None], exercise: str | int | None = None, *, after: str | None = None,
          replace: str | None = None, poison: bool = True) -> Verdict:
    """Run ``fn`` as a step of the exercise on the live ranks and grade it.

    ``where`` is the exploration session (``wb.teach.exercise("01").session(cluster)``) or a cluster with
    ``exercise="01"``. ``fn(ctx)`` runs on every rank in the exercise's slot, or ``after=``/``replace=`` a
    step of your choosing.
    """
    if not callable(fn):
        raise WorkbenchError(f"check() wants your step function (def my_fix(ctx): ...), got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise WorkbenchError(f"{getattr(fn, '__name__', 'your step')} must take one argument, ctx") from None
    cluster = getattr(where, "cluster", where)
    if not hasattr(cluster, "world_size") or not callable(getattr(cluster, "run", None)):
        raise WorkbenchError(f"check() grades on live ranks: give it the exercise's session or a cluster, "
                             f"not a {type(where).__name__}")
    if exercise is None:
        name = getattr(getattr(where, "scenario", None), "name", "")
        if not name.startswith("exercise-"):
            raise WorkbenchError("check(session, fn) wants a session of an exercise "
                                 "(wb.teach.exercise('01').session(cluster)); or pass exercise='01'")
        exercise = name
    ex = get(exercise)
    from workbench.live.session import Session

    scenario = ex.with_step(fn, after=after, replace=replace)  # a bad step name fails here, before the ranks
    warm(cluster)
    s = Session(cluster, scenario, poison=poison)
    try:
        s.run()
        return verdict(ex, s)
    finally:
        s.close()  # the ranks drop this run's models; its frames, ledger rows and diagnosis stay readable
