"""Forward-trace detector: the first module whose output goes wrong, per rank.

Reads the rows ``workbench.rank.trace.trace_forward`` recorded (one per module call, in
the order the calls finished, so a module comes after everything it called). Per rank and
run, three questions, first answer wins the sentence:

- where did the output first go non-finite (NaN/Inf) — and were that module's inputs
  still finite, which puts the fault in the module's own state (its buffers, its weights);
- where did it first depart from rank 0's output of the same module and call;
- where did it first depart from the reference run (``run == "reference"``) on the rank.

Module calls line up across ranks and runs by (module name, n-th call of that module).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from workbench.analysis.frames import fmt

REFERENCE = "reference"
RTOL = 1e-2  # relative gap in absmax / mean|x| that counts as "departs"
ATOL = 1e-6


def _key(df: pd.DataFrame) -> pd.DataFrame:
    df = df.sort_values("call").copy()
    df["nth"] = df.groupby("module").cumcount()
    return df


def _bad(row: Any) -> int:
    total = 0
    for v in (row.nan, row.inf):
        if v is not None and v is not pd.NA and v == v:
            total += int(v)
    return total


def _close(a: float, b: float, rtol: float) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + ATOL


def _exact(dtype: Any) -> bool:
    return isinstance(dtype, str) and dtype.startswith(("int", "uint", "bool"))


def departs(a: Any, b: Any, rtol: float = RTOL) -> bool:
    """Whether call ``a`` differs from call ``b``: non-finite counts, absmax or mean |x|; for integer
    outputs (indices, counts) any change, since there is no rounding to tolerate."""
    if a.fingerprint == b.fingerprint:
        return False
    if _bad(a) != _bad(b) or _exact(a.dtype) or _exact(b.dtype):
        return True
    return not (_close(a.absmax, b.absmax, rtol) and _close(a.meanabs, b.meanabs, rtol))


def _on_cpu(row: Any) -> bool:
    return getattr(row, "device", None) == "cpu"


def _first_departure(rows: pd.DataFrame, against: pd.DataFrame, rtol: float,
                     exact: bool = False) -> tuple[Any, Any, bool] | None:
    """The first call of ``rows`` that departs from its twin in ``against``, and whether only the
    exact rule caught it. ``exact`` (a rank's own reference run): on CPU both runs use the same
    kernels in one process, so the first bit-different output after bit-identical ones departs
    however small the gap (a garbage buffer can move mean |x| by under ``rtol``)."""
    other = {(r.module, r.nth): r for r in against.itertuples(index=False)}
    identical_so_far = True
    for r in rows.itertuples(index=False):
        o = other.get((r.module, r.nth))
        if o is None:
            continue
        if departs(r, o, rtol):
            return r, o, False
        if r.fingerprint != o.fingerprint:
            if exact and identical_so_far and _on_cpu(r) and _on_cpu(o):
                return r, o, True
            identical_so_far = False
    return None


def _departures(rank: int, run: str, g: pd.DataFrame, runs: dict, before: float, rtol: float) -> list[dict]:
    """The first departure from rank 0 and from the reference, where it comes before ``before``."""
    out: list[dict] = []
    where = "" if run == "model" else f" ({run} run)"
    against = [("rank 0", "warning", runs.get((0, run)) if rank != 0 else None),
               ("the reference", "error", runs.get((rank, REFERENCE)))]
    for label, severity, other in against:
        hit = _first_departure(g, other, rtol, exact=label == "the reference") if other is not None else None
        if hit and hit[0].call < before:
            r, o, bitwise = hit
            why = "; bit-different although every earlier output was bit-identical" if bitwise else ""
            out.append({"rank": rank, "run": run, "kind": f"departs from {label}", "severity": severity,
                        "module": r.module, "call": r.call,
                        "finding": f"rank {rank}{where}: first output departing from {label} at "
                                   f"`{r.module}` ({r.type}; absmax {fmt(r.absmax)} vs {fmt(o.absmax)}, "
                                   f"mean|x| {fmt(r.meanabs)} vs {fmt(o.meanabs)}{why})"})
    return out


def _non_finite(rank: int, run: str, g: pd.DataFrame, bad: list, earlier: list[dict]) -> dict:
    """The first non-finite call; its inputs being finite clears upstream only if nothing upstream
    had already departed (huge finite garbage overflows a few modules later)."""
    b = bad[0]
    where = "" if run == "model" else f" ({run} run)"
    if b.in_nonfinite:
        cause = "its inputs were already non-finite"
    elif earlier:
        first = min(earlier, key=lambda d: d["call"])
        cause = f"its inputs were finite but an output departed earlier at `{first['module']}`"
    else:
        cause = "its inputs were finite: the fault is in this module's own state (buffers, weights)"
    return {"rank": rank, "run": run, "kind": "non-finite", "severity": "error", "module": b.module,
            "call": b.call,
            "finding": f"rank {rank}{where}: first non-finite output at `{b.module}` ({b.type}; "
                       f"{_bad(b)} of {b.numel} values; {cause}); "
                       f"{len(bad)} of {len(g)} module outputs non-finite"}


def analyse(trace: pd.DataFrame, rtol: float = RTOL) -> list[dict]:
    """Per (rank, run): the first non-finite call and the first departures before it, as dicts in
    call order, so the first one for a rank is where it first went wrong."""
    out: list[dict] = []
    if trace is None or trace.empty:
        return out
    runs = {(int(rk), run): _key(g) for (rk, run), g in trace.groupby(["rank", "run"], sort=True)}
    for (rank, run), g in runs.items():
        bad = [r for r in g.itertuples(index=False) if _bad(r) > 0]
        first_bad_call = bad[0].call if bad else math.inf
        found = [] if run == REFERENCE else _departures(rank, run, g, runs, first_bad_call, rtol)
        if bad:
            found.append(_non_finite(rank, run, g, bad, found))
        out.extend(sorted(found, key=lambda d: d["call"]))
    return out


def forward_trace(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame,
                  trace: pd.DataFrame | None = None, rtol: float = RTOL, **_: Any) -> list[dict]:
    """Findings rows (the DETECTORS shape) from one step's forward trace; none without a trace."""
    return [{"severity": a["severity"], "rank": a["rank"], "name": a["module"], "detector": "forward trace",
             "finding": a["finding"]} for a in analyse(trace, rtol)]


def first_fault(trace: pd.DataFrame, rank: int, run: str = "model", rtol: float = RTOL) -> str | None:
    """The earliest module that went wrong on ``rank`` in ``run``: non-finite, or departing from
    rank 0 or from the reference."""
    for a in analyse(trace, rtol):
        if a["rank"] == rank and a["run"] == run:
            return a["module"]
    return None
