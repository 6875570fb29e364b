"""Rerun every CPU fixture on engines whose float kernels differ from the recorder's.

``ATEN_CPU_CAPABILITY=default`` turns off the SIMD kernels, which moves the last bits of
matmuls and reductions the way another CPU (AVX2 vs AVX-512, AMD vs Intel) does. Every
fixture should read "reproduced" (exactly, or the same story within rounding): a colleague's
machine must be able to rerun a postmortem. One line per recorded run.

    .venv/bin/python scripts/rerun_other_kernels.py [--capability default]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capability", default="default", help="ATEN_CPU_CAPABILITY for the engines")
    args = p.parse_args(argv)
    os.environ["ATEN_CPU_CAPABILITY"] = args.capability  # the engines inherit it
    import workbench as wb
    from workbench.postmortem import bundle, rerun

    differs = 0
    with wb.start(ranks=2, backend="gloo", timeout=8) as c:
        for path in sorted(glob.glob(str(ROOT / "fixtures" / "bundles" / "*.wbundle"))):
            for rec in bundle.load(path):
                if c.dead_ranks() or not c.wait_idle(c.timeout + 15):
                    c.restart()
                r = rerun.rerun_record(rec, c)
                differs += not r.reproduced
                print(f"{Path(path).stem:34s} {r.message}", flush=True)
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
