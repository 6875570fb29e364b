"""Python stacks of a rank that cannot answer: faulthandler on a signal, into a per-rank file.

A rank blocked inside a collective runs no Python (the wait is in C++, often with the GIL
held by a host sync), so neither an ipyparallel call nor a Python signal handler reaches
it. ``faulthandler`` writes every thread's stack from the C signal handler itself, so the
client can send SIGUSR1 to the engine and read where its main thread sits.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
from typing import Any

_FILE: dict[str, Any] = {}


def install() -> str:
    """Register SIGUSR1 to dump all threads' stacks into this rank's file; returns its path."""
    if "path" not in _FILE:
        fd, path = tempfile.mkstemp(prefix=f"wb-stacks-{os.getpid()}-", suffix=".txt")
        _FILE.update(path=path, fh=os.fdopen(fd, "w"))
        faulthandler.register(signal.SIGUSR1, file=_FILE["fh"], all_threads=True, chain=False)
    return _FILE["path"]
