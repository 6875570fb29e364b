"""Deadlock detection latency at the default settings, and what the release leaves: prints a table.

Three gloo deadlocks, each run ``--cycles`` times on one warm cluster: a user scenario whose rank 1
finishes the step while rank 0 waits in an all-reduce rank 1 never issues (declared at first sight),
the eval-loop incident (both ranks in calls that cannot pair: the 0.3 s hold), and the headline
(rank 1 finishes the wrap, rank 0 waits in its second broadcast). Latency is what the frame records:
declaration time minus the ledger time the last waiting rank entered its call.

    python scripts/deadlock_latency.py [--cycles 5] [--timeout 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import workbench as wb

FINISHED = wb.Scenario("latency-finished-peer", probe=None)


@FINISHED.step
def prepare(ctx) -> None:
    import torch

    ctx.x = torch.ones(8)


@FINISHED.step
def uneven(ctx) -> None:
    import torch.distributed as dist

    dist.all_reduce(ctx.x)
    if ctx.rank == 0:
        dist.all_reduce(ctx.x)


CASES = [("user: peer finished", FINISHED, "uneven", {}),
         ("eval loop: cannot pair", "eval-loop-uneven-batches", "evaluate", {}),
         ("headline: wrap", "fsdp1-rotary-meta-init", "wrap_fsdp1", {})]


def one(cluster: wb.Cluster, scenario, step: str) -> tuple[float | None, float, bool]:
    s = cluster.session(scenario)
    s.run(until=s.steps[s.steps.index(step) - 1])
    t0 = time.perf_counter()
    frame = s.step()
    took = time.perf_counter() - t0
    latency = frame.hang.to_dict()["detected_after_s"] if frame.hang is not None else None
    went_on = s.next_step != step
    s.run()
    rest_ok = all(f.ok or f is frame for f in s.frames)
    s.close()
    return latency, took, went_on and rest_ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=30.0, help="gloo collective timeout (never reached)")
    a = ap.parse_args()
    cluster = wb.start(ranks=2, backend="gloo", timeout=a.timeout, progress=False)
    print("| deadlock (gloo, defaults) | declared after last rank blocked, s (median / max) | step took, s | "
          "session went on |")
    print("| --- | --- | --- | --- |")
    try:
        for label, scenario, step, _ in CASES:
            runs = [one(cluster, scenario, step) for _ in range(a.cycles)]
            lat = [r[0] for r in runs if r[0] is not None]
            took = [r[1] for r in runs]
            print(f"| {label} | {statistics.median(lat):.2f} / {max(lat):.2f} ({len(lat)}/{len(runs)} declared) | "
                  f"{statistics.median(took):.2f} | {sum(r[2] for r in runs)}/{len(runs)} |", flush=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
