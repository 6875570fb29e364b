"""On a GPU machine: the workbench's torch-free GPU count against torch's, for several CUDA_VISIBLE_DEVICES.

Run from the repository root: ``python scripts/gpu_count_check.py``; prints one line per setting and exits 1
on any disagreement. Each count runs in a fresh process (CUDA reads the variable once)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

CODE = """
import time, sys
t = time.perf_counter()
from workbench.rank.host import gpu_count
ours, ours_s = gpu_count(), time.perf_counter() - t
import torch
print(ours, torch.cuda.device_count(), round(ours_s * 1000, 2))
"""


def main() -> int:
    bad = 0
    for visible in (None, "0", "1,0", "0,-1,1", "0,99", ""):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
        ours, theirs, ms = out.stdout.split()
        ok = ours == theirs
        bad += not ok
        print(f"CUDA_VISIBLE_DEVICES={visible!s:8} workbench {ours} torch {theirs} ({ms} ms without torch; "
              f"{time.perf_counter() - t:.1f} s in all) {'ok' if ok else 'DIFFERS'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
