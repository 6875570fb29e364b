"""The recorded real-size GPU runs against their speed goals: `python benchmarks/gpu_recorded.py`.

The recordings (fixtures/gpu/real_size*.json, written by benchmarks/real_size.py through
scripts/gpu_real_size.sh) carry each figure beside its goal; this prints them as a table. Tests only check
that a recording is consistent (tests/test_gpu_recordings.py); whether a figure meets its goal is said here.
"""

from __future__ import annotations

import json
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "fixtures" / "gpu"
RECORDINGS = ["real_size.json", "real_size_round1.json", "real_size_nowarm.json", "real_size_gc.json",
              "real_size_gc_freeze.json", *(f"real_size_4gpu_run{i}.json" for i in (1, 2, 3))]
FIGURE = {"overhead": "worst_s", "first_probe": "slowest_probe_s", "start": "start_s"}


def rows() -> list[tuple[str, int, str, float, float, bool]]:
    """(recording, ranks, goal, figure s, goal s, met) for every goal of every recorded run."""
    out = []
    for name in RECORDINGS:
        try:
            runs = json.loads((GPU / name).read_text())["runs"]
        except (OSError, KeyError, ValueError):
            continue
        for run in runs:
            for goal, g in run.get("goals", {}).items():
                figure = g.get(FIGURE.get(goal, ""), float("nan"))
                out.append((name, run["ranks"], goal, figure, g.get("goal_s", float("nan")), bool(g.get("met"))))
    return out


def main() -> None:
    print(f"{'recording':28s} {'GPUs':>4s} {'goal':12s} {'figure s':>9s} {'goal s':>7s}  met")
    for name, ranks, goal, figure, goal_s, met in rows():
        print(f"{name:28s} {ranks:4d} {goal:12s} {figure:9.3f} {goal_s:7.2f}  {'yes' if met else 'NO'}")


if __name__ == "__main__":
    main()
