"""Where the client's time goes in a step: cProfile of whole-scenario reruns on live ranks.

`python benchmarks/profile_step.py [N]` runs the headline's fix path N times (default 10) on
2 gloo ranks under cProfile and prints the top functions by cumulative and by own time. The
ranks' own work does not show here (it runs in the engines); what shows is waiting for them
(ipyparallel's polling) and the client's frame building, ledger reading and findings.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import workbench as wb

SCENARIO, FIX = "fsdp1-rotary-meta-init", "cast-params-only"


def main(n: int = 10) -> None:
    with wb.start(ranks=2, backend="gloo", timeout=8, progress=False) as cluster:
        cluster.session(SCENARIO, fix=FIX).run()  # warm: imports and first calls on the engines
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            s = cluster.session(SCENARIO, fix=FIX)
            s.run()
            s.close()
        prof.disable()
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(18)
        print(f"== by {key} ({n} runs of {len(s.steps)} steps)")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
