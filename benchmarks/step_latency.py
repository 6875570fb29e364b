"""Where a step's overhead goes: the way there, the ranks' probe, the way back, the client.

    python benchmarks/step_latency.py [RUNS]     # default 8 reruns of the headline's fix path, 2 gloo ranks

`make bench` prints one figure, the per-step overhead (a step's client wall time minus the
slowest rank's step). This splits it, from wall-clock stamps the ranks take around their
`run_step` (same host, same clock) and the client takes around its call, medians over every
step of every rerun:

- start: the call begun -> the last rank inside `run_step` (the client's submit, ipyparallel's
  routing, the engines unpacking the call); the first rank's start too
- probe: the slowest rank's probe, annotate and outputs (`probe_s`)
- back: the last rank out of `run_step` -> the client holding every result (the engines packing
  the rows, the routing back, the client unpacking)
- client: the step's wall time outside the call (frame, ledger rows)
- pickle: what the slowest result costs to pickle on its rank, and its size

ipyparallel's own round trip (`apply_sync` of a no-op on both engines) is measured in the same run.
"""

from __future__ import annotations

import statistics
import sys
import time

from run import _timed_n  # benchmarks/run.py: `make bench`'s timer (this script runs from benchmarks/)

import workbench as wb
from workbench.live.engines import Engines

SCENARIO, FIX = "fsdp1-rotary-meta-init", "cast-params-only"


def _stamp_ranks() -> int:
    """On a rank: wrap ``run_step`` to keep (t_in, t_out, elapsed, probe_s, pickle_s, pickled bytes) per call."""
    import pickle
    import sys
    import time

    from workbench.rank import remote

    kept = sys.__dict__.setdefault("_wb_step_latency", [])
    inner = remote.run_step
    if getattr(inner, "_stamped", False):
        return 0

    def stamped(*args, **kwargs):
        t_in = time.time()
        out = inner(*args, **kwargs)
        t_out = time.time()
        p0 = time.perf_counter()
        size = len(pickle.dumps(out, protocol=5))
        kept.append((t_in, t_out, out["elapsed"], out["probe_s"], time.perf_counter() - p0, size))
        return out

    stamped._stamped = True
    remote.run_step = stamped
    return 0


def _taken() -> list:
    import sys

    kept = sys.__dict__.get("_wb_step_latency", [])
    out = list(kept)
    kept.clear()
    return out


def _noop() -> int:
    return 0


def main(runs: int = 8) -> None:
    calls: list[tuple[float, float]] = []
    steps: list[tuple[float, float]] = []
    call = Engines.call

    def timed_call(self, fn, *args, **kwargs):
        t0 = time.time()
        try:
            return call(self, fn, *args, **kwargs)
        finally:
            if getattr(fn, "name", "") == "run_step":
                calls.append((t0, time.time()))

    Engines.call = timed_call
    try:
        with wb.start(ranks=2, backend="gloo", timeout=8, progress=False) as cluster:
            view = cluster._client[cluster._ids]
            floor = statistics.median(_timed_n(lambda: view.apply_sync(_noop), 40))
            cluster.run(_stamp_ranks)
            cluster.session(SCENARIO, fix=FIX).run()  # warm
            calls.clear()
            cluster.run(_taken)
            for _ in range(runs):
                s = cluster.session(SCENARIO, fix=FIX)
                for _ in s.steps:
                    t0 = time.time()
                    s.step()
                    steps.append((t0, time.time()))
                s.close()
            ranks = cluster.run(_taken)
    finally:
        Engines.call = call
    rows = []
    for i, ((c0, c1), (s0, s1)) in enumerate(zip(calls, steps)):
        r = [ranks[k][i] for k in sorted(ranks)]
        slowest = max(r, key=lambda v: v[1])
        rows.append({
            "first rank starts": min(v[0] for v in r) - c0, "last rank starts": max(v[0] for v in r) - c0,
            "probe (slowest rank)": max(v[3] for v in r), "back": c1 - max(v[1] for v in r),
            "client outside the call": (c0 - s0) + (s1 - c1), "overhead": (s1 - s0) - max(v[2] for v in r),
            "pickle (slowest rank)": slowest[4], "pickled KB": slowest[5] / 1e3,
        })
    print(f"{len(rows)} steps ({runs} reruns of {SCENARIO} --fix {FIX}, 2 gloo ranks); medians")
    for key in rows[0]:
        v = statistics.median(row[key] for row in rows)
        print(f"  {key:28s} {v:8.2f} KB" if key.endswith("KB") else f"  {key:28s} {v * 1e3:8.2f} ms")
    print(f"  {'ipyparallel apply_sync':28s} {floor * 1e3:8.2f} ms  (a no-op on both engines, same run)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
