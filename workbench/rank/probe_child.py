"""The fused probe's kernel built in a child process, seen from the rank that starts it (torch-free at import).

``prebuild_probe`` starts ``python -m workbench.rank._probe_build``; ``await_prebuild`` (off the job's thread:
``probe_fused.warm_async``'s thread) waits for it. Torch-free so that a capture can start the build as it opens,
before torch or CUDA are up.
"""

from __future__ import annotations

import os
import sys
import time

_BUILD: dict = {}  # the child: "proc" while it runs, then "result" (what it printed) and "seconds"
BUILD_LIMIT_S = 120.0  # a build that takes longer is left to finish alone; the rank's own warm-up builds then


def prebuild_probe(device: int | str = "local") -> bool:
    """Start building the fused probe's Triton kernel in a child process (once per process): the cold build
    (Triton's import, its C helpers, the kernel's compile: ~9 s on an H200 with an empty cache) then fills
    Triton's on-disk cache with no work on this process's threads. Compiling in-process holds the GIL for
    seconds at a time, which slows every step a job runs meanwhile; the rank's own warm-up
    (``probe_fused.warm_async``) waits for the child, then only loads what it built. Torch-free, so a
    capture can start it before torch or CUDA are up; ``device``: a CUDA index, or ``"local"`` (the rank's
    ``LOCAL_RANK``). Returns whether a child runs or ran. WORKBENCH_PROBE_CHILD_BUILD=0 (or the warm-up or
    the fused probe off) turns it off."""
    if "proc" in _BUILD or "result" in _BUILD:
        return True
    if any(os.environ.get(k, "1") == "0" for k in ("WORKBENCH_PROBE_CHILD_BUILD", "WORKBENCH_PROBE_WARM",
                                                    "WORKBENCH_PROBE_FUSED")):
        return False
    if cache_holds_kernel():  # a warm cache: loading in-process takes ~0.5 s, a child's torch and CUDA ~4 s
        return False
    if device == "local" and not _gpus_here():  # a capture opening on a CPU job: no child (its torch import costs)
        return False
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_CAPTURE"}  # the child is no rank to capture
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    try:
        _BUILD["proc"] = subprocess.Popen(
            [sys.executable, "-m", "workbench.rank._probe_build", str(device)], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError as exc:  # no child: the rank's warm-up builds in-process, as before
        _BUILD["result"] = {"warm": False, "why": f"{type(exc).__name__}: {exc}"}
        return False
    _BUILD["t0"] = time.perf_counter()
    return True


def _gpus_here() -> bool:
    """Whether this process may see an NVIDIA GPU, read without CUDA (a capture asks before torch is up): a device
    node, and CUDA_VISIBLE_DEVICES not emptied."""
    import glob

    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def cache_holds_kernel(name: str = "probe_all_kernel") -> bool:
    """Whether Triton's on-disk cache holds a build of the probe's kernel (``<cache>/<hash>/<name>.cubin``): then
    the rank's own warm-up only loads it (~0.5 s on an H200), sooner than a child could start (torch's import
    and CUDA's start there: ~4 s, read on an H200). A build for another Triton or another source of the kernel
    also counts: that warm-up then builds in-process, as it did before the child."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")
    try:
        with os.scandir(root) as entries:
            return any(os.path.exists(os.path.join(e.path, name + ".cubin")) for e in entries if e.is_dir())
    except OSError:
        return False


def await_prebuild(limit: float = BUILD_LIMIT_S) -> dict | None:
    """Wait (up to ``limit`` s) for the child ``prebuild_probe`` started; what it reported, None where none ran.
    Waiting on a child releases the GIL: call it off the job's thread."""
    proc = _BUILD.get("proc")
    if proc is None:
        return _BUILD.get("result")
    import json
    import subprocess

    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        return {"warm": False, "why": f"the child build ran past {limit:g}s"}
    _BUILD.pop("proc", None)
    lines = [x for x in (out or "").splitlines() if x.startswith("{")]
    try:
        result = json.loads(lines[-1]) if lines else {"warm": False, "why": f"the child build exited {proc.returncode}"}
    except ValueError:
        result = {"warm": False, "why": "the child build printed no result"}
    result["wall_s"] = time.perf_counter() - _BUILD.get("t0", time.perf_counter())
    _BUILD["result"] = result
    return result
