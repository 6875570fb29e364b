"""The diagnosis: the first place a run went wrong, classified, in one sentence.

The detectors (``findings``, ``collectives``, ``trace``) each answer one question per
step; an engineer in an incident wants the story. ``diagnose(record)`` walks a run in
causal order and keeps only what explains the end state:

1. a weight stream out of its receiver's plan (the first cause, however the bytes look);
2. the collectives ledger: the first call on which the ranks disagree (an extra bucket,
   a different op, a rank that never issued the call), then what it left behind on the
   receiving rank (bytes of another dtype or tensor, tensors nobody wrote) and who then
   timed out, hung or died; a tensor already wrong on its own terms before it comes first;
3. a rank that died or hung with no disagreement in the ledger;
4. tensors still wrong at the last step, traced back to the step they went wrong in and
   stayed wrong from: never written since materialisation, the same wrong value on every
   rank (only the reference sees it), a dtype split, plain divergence;
5. outputs that depart while every probed tensor agrees: the cause is outside the probe;

then how the ranks' exceptions join that story. The order is a list of rules, one list per
stage in ``workbench.analysis.diagnosis_rules`` (story, parting, tensor, exception); ``rules()``
shows it as a table: each rule's name, when it fires and what it says. A new finding is a rule
put in its place. Faults that a later step repairs (rank 1's tensors between ``to_empty`` and
the state dict load) are not causes. ``record`` is anything with ``tensors``, ``outputs``,
``events``, ``ledger``, ``trace`` tables and a ``manifest`` (a RunRecord, duck-typed so
this module stays below the postmortem layer; ``diagnosis_run`` reads it, once per record). A
``Diagnosis`` is its clauses (``diagnosis_words``): each clause's words and what it tells as data (who
raised, who is stuck, which groups parted, which tensors, which outputs); the sentence is rendered
from them, and no rule reads it back. The figure is built by ``workbench.viz.diagnosis.figure`` from
``Diagnosis.grid``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from workbench.analysis.diagnosis_rules import RULES, diagnose_run, rules
from workbench.analysis.diagnosis_run import BAD, Run
from workbench.analysis.diagnosis_type import EVIDENCE_COLUMNS, GRID_COLUMNS, Clause, Diagnosis
from workbench.analysis.diagnosis_words import GRID_STATUSES, dt, short
from workbench.analysis.frames import fmt
from workbench.analysis.rankgroups import ranks_words as _ranks

__all__ = ["BAD", "EVIDENCE_COLUMNS", "GRID_COLUMNS", "GRID_STATUSES", "RULES", "Clause", "Diagnosis", "_ranks",
           "diagnose", "diagnose_comparison", "dt", "grid", "parted", "rules", "short"]


def diagnose(record: Any) -> Diagnosis:
    """The first cause of what went wrong in one run (see the module docstring), or ``clean``."""
    run = Run.of(record)
    d = diagnose_run(run)
    d.grid = grid(run, d)
    return d


# -- the figure's data ---------------------------------------------------------------------------
def grid(run: Run | Any, d: Diagnosis | None = None) -> pd.DataFrame:
    """One cell per (step, rank): ok, fault (n tensors wrong), failed, hung or not run; what the figure draws."""
    run = Run.of(run)
    stuck = {(s["step"], s["rank"]): s["how"] for s in run.stuck}
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


def _split_cells(run: Run, step: str, d: Diagnosis | None) -> dict[int, str]:
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
    a, b = Run.of(bug), Run.of(fix)  # each read once per record: diagnose_comparison's own are these
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
    a, b = Run.of(bug), Run.of(fix)  # each run read once: its diagnosis, the parting and the words share it
    d = diagnose(a)
    d.fix = diagnose(b)
    d.parted = parted(a, b)
    label = (getattr(fix, "manifest", {}) or {}).get("fix") or "the fix"
    if d.parted:
        p = d.parted
        d.add(Clause(f". The fix `{label}` parts from the bug path at step `{p['step']}` (rank {p['rank']} "
                     f"`{short(p['name'], a.names)}`: {p['what']})", "comparison", p),
              *([Clause(" and is clean", "comparison")] if d.fix.clean else
                [Clause(", but is not clean: ", "comparison"), *d.fix.clauses]))
    else:
        d.add(Clause(f". The fix `{label}` holds the same bytes as the bug path at every step", "comparison"))
    return d
