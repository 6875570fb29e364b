"""The recorded GPU runs against their speed goals: `python benchmarks/gpu_recorded.py`.

The real-size recordings (fixtures/gpu/real_size*.json, written by benchmarks/real_size.py through
scripts/gpu_real_size.sh) carry each figure beside its goal; issue 62's (job_leave_on_1gpu.json, the capture left
on: a point every step at <= 1.03x the step, the first point <= 0.5 s; probe_scale_reread_1gpu.json, the probe at
<= 1.5x its read-once floor) are read against the issue's goals. This prints them as tables. Tests only check
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


def leave_on() -> list[tuple[str, str, float, float, bool]]:
    """(what, measure, figure, goal, met) for issue 62's recordings: each capturing job's step plus point over step
    within the job (the median, and its 95% interval's top), the first point, the probe at scale."""
    out = []
    try:
        rec = json.loads((GPU / "job_leave_on_1gpu.json").read_text())
    except (OSError, ValueError):
        rec = {"runs": []}
    for run in rec["runs"]:
        for how in ("eager", "compiled"):
            paired = (run.get(how) or {}).get("paired")
            if paired:
                what = f"{run['mode_key']} {how} {'fresh' if run['fresh'] else 'warm'}"
                out.append((what, "median", paired["pair_ratio"], 1.03, paired["pair_ratio"] <= 1.03))
                out.append((what, "ci95 top", paired["ci95"][1], 1.03, paired["ci95"][1] <= 1.03))
    for when, ms in (rec.get("first_point_ms") or {}).items():
        out.append((f"first point, {when}", "ms", ms, 500.0, ms <= 500.0))
    try:
        scale = json.loads((GPU / "probe_scale_reread_1gpu.json").read_text())
        x = scale["paths"]["fused"]["probe_ms"] / scale["floor_ms"]
        out.append(("probe at scale", "x floor", x, 1.5, x <= 1.5))
    except (OSError, KeyError, ValueError):
        pass
    return out


def main() -> None:
    print(f"{'recording':28s} {'GPUs':>4s} {'goal':12s} {'figure s':>9s} {'goal s':>7s}  met")
    for name, ranks, goal, figure, goal_s, met in rows():
        print(f"{name:28s} {ranks:4d} {goal:12s} {figure:9.3f} {goal_s:7.2f}  {'yes' if met else 'NO'}")
    print(f"\n{'issue 62, one H200':32s} {'measure':9s} {'figure':>8s} {'goal':>7s}  met")
    for what, measure, figure, goal, met in leave_on():
        print(f"{what:32s} {measure:9s} {figure:8.3f} {goal:7.2f}  {'yes' if met else 'NO'}")


if __name__ == "__main__":
    main()
