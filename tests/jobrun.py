"""A torchrun job run by a test, run again only where it met torch's own exit abort.

Why: a rank whose gloo group outlives the job's code (a script's module-level DDP model; DeepSpeed's parameters:
``job/teardown.py``) may abort in interpreter finalisation after its last line, when a worker dropping a backward's
last work takes the GIL. It is torch's trap, with or without the workbench (docs/stacks.md: 3 of 60 plain DeepSpeed
runs; CI's run of 21da7d0 met it in a plain DeepSpeed job, a fresh clone of 1f00dcc in plain ``clean_job.py``).
What the tests compare is the job with and without the workbench, not that trap's dice. The workbench's own exit
aborts (a watcher in a store call, a pinned group) have tests that run once (test_job_guest, test_close_leaves_torch,
test_job_faults): they never come here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

EXIT_ABORT = "terminate called without an active exception"


def exit_abort(run: subprocess.CompletedProcess) -> bool:
    """Whether ``run`` failed with torch's exit abort (that line, and the launcher saying SIGABRT), nothing else."""
    return run.returncode != 0 and EXIT_ABORT in (run.stderr or "") and "SIGABRT" in (run.stderr or "")


def run(cmd: list[str], fresh: Path | str | None = None, tries: int = 3, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)`` (text output captured), again (``tries`` in all) only where it met the exit
    abort; ``fresh``: a folder the job writes (a capture), emptied before a rerun."""
    kwargs = {"capture_output": True, "text": True, **kwargs}
    for attempt in range(tries):
        if attempt and fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
        done = subprocess.run(cmd, **kwargs)
        if not exit_abort(done):
            return done
    return done
