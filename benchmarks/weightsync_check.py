"""How fast the streamed-name check fails, and what it costs when it passes (2 gloo ranks, CPU).

- fail: ``weight-sync-order-desync --fix check-streamed-names``, the ``deliver`` step where
  plan and stream disagree: each rank's own time in the step until it raised (goal: well
  under a second, instead of a silent load or a hang until the collective timeout);
- pass: the ``deliver`` step with ``one-chunk-plan`` alone vs ``one-chunk-plan+check-streamed-names``
  (the check's price: one small object broadcast per packed buffer, plus the end marker).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/weightsync_check.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

SCENARIO = "weight-sync-order-desync"


def deliver_times(cluster, fix: str, repeats: int) -> tuple[list[float], set[str]]:
    """Per repeat, the slowest rank's own time in ``deliver``; and the errors seen there."""
    times, errors = [], set()
    for _ in range(repeats):
        s = cluster.session(SCENARIO, fix=fix)
        s.run(until="deliver")
        frame = s.frames[-1]
        times.append(max(frame.elapsed.values()))
        errors |= {str(e.error) for e in frame.events.itertuples()}
        s.close()
    return times, errors


def ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})"


def main(argv: list[str] | None = None) -> int:
    import workbench as wb

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    with wb.start(ranks=2, backend="gloo", timeout=8) as cluster:
        fail, errs = deliver_times(cluster, "check-streamed-names", args.repeats)
        plain, _ = deliver_times(cluster, "one-chunk-plan", args.repeats)
        checked, _ = deliver_times(cluster, "one-chunk-plan+check-streamed-names", args.repeats)
    print(f"check fails (plan and stream disagree): {ms(fail)}; errors: {', '.join(sorted(errs))}")
    print(f"deliver, one-chunk-plan:             {ms(plain)}")
    print(f"deliver, one-chunk-plan + the check: {ms(checked)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
