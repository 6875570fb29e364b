"""The capture is a guest in the user's job: its own failures are one line on stderr, never the job's.

Every error inside ``capture``, a point, ``close``, the exception hook, the ledger's and the poison's
hooks (a full disk, a path that cannot be made, a read-only file system, an object the probe cannot
read, a bug of the workbench's) becomes one line naming where the capture stopped, the cause, and what
the shard kept::

    workbench: rank 1: capture stopped at point `step2`: no space left on device (runs/x/rank1); runs/x/rank1
    keeps 2 point(s) up to `step1`; the job goes on without it

(one line on stderr), and the capture turns itself off on that rank: its modes, wrappers, hooks and
files go, and every later call into it returns at once. The job's own exceptions, exit status and
output are unchanged. ``capture(..., strict=True)`` raises instead (tests, or a job that would rather
fail fast). A hook that fails on another thread (a backend's completion callback) only marks the
capture off; the modes leave at the job's next call into the capture, on its own thread (a mode
leaves its stack from the top only: one the job pushed above ours since stays, ours below it passing
every call through).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any

WORDS = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only file system",
         errno.ENOTDIR: "not a directory", errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
         errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file too large", errno.EISDIR: "is a directory",
         errno.ENOENT: "no such file or directory", errno.EIO: "input/output error"}


def cause(exc: BaseException, where: Any = None) -> str:
    """The cause in words: an OS error by its errno and path (``where`` when the error names none: a write
    has no file name), anything else as ``Type: message``."""
    if isinstance(exc, OSError) and exc.errno:
        path = exc.filename if exc.filename is not None else where
        what = WORDS.get(exc.errno) or str(exc.strerror or exc).lower()
        return f"{what} ({os.fspath(path)})" if path is not None else what
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def say(line: str) -> None:
    """One line on the job's stderr (the process's own, not a stream a breakpoint's engine put there)."""
    stream = sys.__stderr__ or sys.stderr
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed, full or absent stderr: nothing to say
        stream.write(" ".join(line.split()) + "\n")
        stream.flush()
