"""One real scenario hang, declared from the ledgers and recovered on the same engines, then its fix.

    python scripts/scenario_hang_cycle.py [--backend nccl] [--timeout 30] [--cycles 3]

The eval-loop incident: rank 0 enters an all_reduce while rank 1 enters an all_gather, both
blocked. The collective timeout is long on purpose (30 s): only the ledger proof can end
the wait early, and only the control threads' abort can free the ranks before it. Prints,
per cycle: the detection latency after the last rank blocked, the recovery time and action,
whether the engine processes are the same, and whether the fix path then runs clean.
"""

from __future__ import annotations

import argparse
import time

import workbench as wb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--scenario", default="eval-loop-uneven-batches")
    ap.add_argument("--until", default="load_data", help="the step before the one that hangs")
    ap.add_argument("--fix", default="allreduce-has-data-min")
    a = ap.parse_args()
    c = wb.start(ranks=2, backend=a.backend, timeout=a.timeout)
    c.detect_deadlocks = True
    try:
        pids = dict(c.pids)
        for i in range(a.cycles):
            s = c.session(a.scenario)
            s.run(until=a.until)
            s.deadline = a.timeout * 3  # a backstop only
            t0 = time.perf_counter()
            frame = s.step()
            took = time.perf_counter() - t0
            hang = frame.hang
            if hang is None:
                print(f"{i + 1}: no hang ({took:.2f}s); kinds {sorted(frame.kinds)}")
                s.close()
                continue
            detect = hang.to_dict().get("detected_after_s")
            t1 = time.perf_counter()
            info = s.recover()
            rec = time.perf_counter() - t1
            fixed = s.compare(a.fix).fixed
            print(f"{i + 1}: {hang.caught_by}: stuck {dict(hang.stuck)}; step waited {took:.2f}s, declared "
                  f"{detect}s after the last rank blocked; recover {rec:.2f}s ({info['action']}; aborted "
                  f"{info.get('aborted')}); same engines {dict(c.pids) == pids}; fix clean "
                  f"{all(f.ok for f in fixed.frames)}", flush=True)
            s.close()
            fixed.close()
    finally:
        c.stop()


if __name__ == "__main__":
    main()
