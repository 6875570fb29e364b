"""The fused probe's kernel, built in a child process (``probe_child.prebuild_probe`` starts it; no rank imports it).

    python -m workbench.rank._probe_build [CUDA index | local]

Runs ``probe_fused.warm`` on the given device: Triton's C helpers, the kernel and its launcher are compiled
into Triton's on-disk cache (``TRITON_CACHE_DIR``, inherited), where the rank that started this child then
finds them. Prints one JSON line: what the warm-up took. Exit status 0 when it built.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    t0 = time.perf_counter()
    try:
        import torch

        from workbench.rank import probe_fused

        if not torch.cuda.is_available():
            print(json.dumps({"warm": False, "why": "no CUDA device"}))
            return 1
        which = argv[0] if argv else "local"
        index = int(os.environ.get("LOCAL_RANK", 0)) if which == "local" else int(which)
        index %= torch.cuda.device_count()
        torch.cuda.set_device(index)
        result = probe_fused.warm(torch.device("cuda", index))
    except Exception as exc:  # a process's boundary: any failure is said in its JSON line; the rank builds in-process
        result = {"warm": False, "why": f"{type(exc).__name__}: {exc}"}
    result["child_s"] = time.perf_counter() - t0
    print(json.dumps(result), flush=True)
    return 0 if result.get("warm") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
