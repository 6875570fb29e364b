"""A sweep: the bug path over a grid of meshes and parameters, and where the bug shows.

An engineer root-causing an incident first asks at which mesh it appears (the weight-sync
incident "worked at PP=2" and broke above it). ``sweep`` answers with one table: a row per
(world size, parameter combination), whether the bug path's diagnosis reads clean or names a
mechanism, its one sentence, and the largest departure of an output from its reference.

Each world size gets its own ranks (started, used for every combination, stopped); a
combination the scenario's mesh cannot lay out is a row saying so, never a started engine.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from workbench.errors import WorkbenchError

SWEEP_COLUMNS = ["ranks", "params", "shows", "mechanism", "gap", "sentence", "failed_steps", "wall_s"]


@dataclass
class Sweep:
    """The grid's results: ``table`` (one row per cell) and what was swept."""

    scenario: str
    fix: str | None
    grid: dict[str, list[Any]]
    table: pd.DataFrame

    def where(self) -> str:
        """One line: the cells where the bug path reads clean and where it shows."""
        t = self.table[self.table["mechanism"] != "unsupported"]
        shows = [_cell(r) for r in t[t["shows"]].itertuples(index=False)]
        silent = [_cell(r) for r in t[~t["shows"]].itertuples(index=False)]
        path = f"fix {self.fix}" if self.fix else "the bug path"
        return (f"{self.scenario}, {path}: shows at {', '.join(shows) or 'no cell'}; "
                f"clean at {', '.join(silent) or 'no cell'}")

    def __str__(self) -> str:
        shown = self.table.assign(sentence=self.table["sentence"].str.slice(0, 110))
        return self.where() + "\n" + shown.drop(columns=["params"]).to_string(index=False)


def _cell(row: Any) -> str:
    extra = ", ".join(f"{k}={v}" for k, v in row.params.items())
    return f"N={row.ranks}" + (f" ({extra})" if extra else "")


def combinations(grid: dict[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, in the order given (an empty grid: one empty combination)."""
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(list(grid[k]) for k in keys))]


def sweep(scenario: Any, ranks: Iterable[int] = (2,), grid: dict[str, Sequence[Any]] | None = None, *,
          fix: str | None = None, poison: bool = True, backend: str = "auto", timeout: float = 60.0,
          cluster: Any = None, progress: Callable[[str], Any] | None = None) -> Sweep:
    """Run ``scenario`` (its bug path, or ``fix``) at every world size in ``ranks`` and every
    combination of ``grid`` (parameter -> values); see the module docstring.

    Bad input (an unknown parameter or fix, a value of the wrong type) fails before any engine
    starts. ``cluster``: ranks you already hold (``wb.start`` or ``wb.connect``) serve the world size
    they have, and stay up; every other world size gets its own, stopped after its cells.
    """
    from workbench import scenarios

    sc = scenarios.resolve(scenario) if isinstance(scenario, str) else scenario
    sc.check_fix(fix)
    grid = {k: list(v) for k, v in (grid or {}).items()}
    cells = [(int(n), sc.resolve_params(combo), combo) for n in ranks for combo in combinations(grid)]
    if not cells:
        raise WorkbenchError("sweep: nothing to run (no world size or an empty value list)")
    from workbench.live.cluster import start

    rows: list[dict[str, Any]] = []
    for n in dict.fromkeys(c[0] for c in cells):
        todo = [(p, combo) for m, p, combo in cells if m == n]
        runnable = []
        for params, combo in todo:
            try:
                sc.check_ranks(n, params)
                runnable.append((params, combo))
            except WorkbenchError as exc:
                rows.append(_row(n, combo, "unsupported", str(exc)))
        if not runnable:
            continue
        mine = cluster is not None and getattr(cluster, "world_size", None) == n
        ranks_n = cluster if mine else start(ranks=n, backend=backend, timeout=timeout, progress=False)
        try:
            for params, combo in runnable:
                if progress:
                    progress(f"sweep: N={n} {combo or ''}")
                rows.append(_run_cell(ranks_n, sc, n, params, combo, fix, poison))
        finally:
            if not mine:
                ranks_n.stop()
    table = pd.DataFrame(rows, columns=SWEEP_COLUMNS)
    return Sweep(sc.name, fix, grid, table)


def _row(n: int, combo: dict[str, Any], mechanism: str, sentence: str, **extra: Any) -> dict[str, Any]:
    return {"ranks": n, "params": dict(combo), "shows": False, "mechanism": mechanism, "gap": float("nan"),
            "sentence": sentence, "failed_steps": "", "wall_s": float("nan"), **extra}


def _run_cell(cluster: Any, sc: Any, n: int, params: dict[str, Any], combo: dict[str, Any],
              fix: str | None, poison: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    s = cluster.session(sc, fix=fix, poison=poison, **params)
    try:
        s.run()
        d = s.diagnose()
        gap = output_gap(s.outputs)
        failed = ",".join(f.step for f in s.frames if not f.ok)
    finally:
        s.close()
    if any(not f.ok for f in s.frames) and hasattr(cluster, "recover"):
        cluster.recover()  # a hang or a dead rank must not leak into the next cell
    return {"ranks": n, "params": dict(combo), "shows": d.mechanism != "clean", "mechanism": d.mechanism,
            "gap": gap, "sentence": d.sentence, "failed_steps": failed, "wall_s": time.perf_counter() - t0}


def output_gap(outputs: pd.DataFrame) -> float:
    """The largest departure of any output from its reference (inf for NaN), NaN when none is declared."""
    if outputs is None or outputs.empty or "ref_max_abs_diff" not in outputs:
        return float("nan")
    vals = [float(v) for v in outputs["ref_max_abs_diff"] if isinstance(v, (int, float)) and not isinstance(v, bool)]
    vals = [v for v in vals if not math.isnan(v)]
    return max(vals) if vals else float("nan")
