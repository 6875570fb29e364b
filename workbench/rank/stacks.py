"""Python stacks of a rank that cannot answer: faulthandler on a signal, into a per-rank file.

A rank blocked inside a collective runs no Python (the wait is in C++, often with the GIL
held by a host sync), so neither an ipyparallel call nor a Python signal handler reaches
it. ``faulthandler`` writes every thread's stack from the C signal handler itself, so the
client can send SIGUSR1 to the engine and read where its main thread sits.
"""

from __future__ import annotations

import atexit
import faulthandler
import glob
import os
import re
import signal
import tempfile
from typing import Any

_FILE: dict[str, Any] = {}


def install() -> str:
    """Register SIGUSR1 to dump all threads' stacks into this rank's file; returns its path."""
    if "path" not in _FILE:
        sweep_stale()
        from workbench.rank import leftovers

        leftovers.own_temp_paths()  # a killed engine's vLLM checkpoint, work dirs: found by the next sweep
        fd, path = tempfile.mkstemp(prefix=f"wb-stacks-{os.getpid()}-", suffix=".txt")
        _FILE.update(path=path, fh=os.fdopen(fd, "w"))
        faulthandler.register(signal.SIGUSR1, file=_FILE["fh"], all_threads=True, chain=False)
        atexit.register(_remove, path)  # a clean exit; a killed engine's file goes in the next sweep
    return _FILE["path"]


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# Temp files and dirs named after the engine process that made them: <pid> is the group. What a process made
# under other names, its manifest lists (leftovers.own_temp_paths).
STALE = (re.compile(r"wb-stacks-(\d+)-\w{8}\.txt"), re.compile(r"wb-(?!ledger-).+-r\d+-p(\d+)-\w{8}"))


def sweep_stale(directory: str | None = None, pids: Any = None) -> int:
    """Remove the stacks files and session work dirs of engine processes that no longer exist (engines are
    killed, not asked to exit, so they cannot clean up themselves), and what their torch shared-memory
    managers left (``leftovers``). A live or foreign pid's are kept. ``pids``: processes the caller has
    just killed (their shared-memory segments go at once; others' only once old)."""
    from workbench.rank import leftovers

    directory = directory or tempfile.gettempdir()
    killed = {int(p) for p in pids or ()}  # gone, though one may be a zombie PID 1 has not reaped yet
    n = leftovers.sweep(directory, pids) + (leftovers.sweep_segments() if pids is not None else 0)
    n += leftovers.sweep_manifests(directory, lambda pid: pid in killed or not leftovers.alive(pid))
    for path in glob.glob(os.path.join(directory, "wb-*")):
        name = os.path.basename(path)
        m = next((m for rx in STALE if (m := rx.fullmatch(name))), None)
        if m is None or not (int(m.group(1)) in killed or not leftovers.alive(int(m.group(1)))) or os.path.islink(path):
            continue
        n += leftovers.remove(path)
    return n
