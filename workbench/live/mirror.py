"""Ledgers of ranks on other hosts, copied to the client before each read.

A session's ranks append their ledgers to files in a directory the client made in its own
temp dir, and the client reads them while ranks are stuck (the engine cannot answer then).
A rank on another host writes the same path on *its* host: the client never sees those
files (found by the namespace tests, where each host has its own /tmp, as nodes do). So
before each read the client asks every remote rank's control thread, which answers while
the rank is stuck, for the bytes appended since the last copy (``control.tail``) and
appends them to its own copy of the file; the reader then reads every rank as before.
"""

from __future__ import annotations

import base64
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ASK_S = 1.0  # one control round trip to a remote rank; a host that misses it is skipped for a while
SKIP_S = 5.0  # how long an unanswering rank is left out (an unreachable host must not slow every poll)


class LedgerMirror:
    """Copies remote ranks' ledger files of one session into the client's ledger dir."""

    def __init__(self, cluster: Any, session: Any):
        self.cluster, self.session = cluster, session
        self._silent: dict[int, float] = {}  # rank -> when it last failed to answer

    def remote(self) -> list[int]:
        now = time.monotonic()
        return [r for r in range(self.cluster.world_size) if not self.cluster.is_local(r)
                and self.cluster.controls.get(r) and now - self._silent.get(r, -SKIP_S) >= SKIP_S]

    def pull(self) -> int:
        """Copy what the remote ranks appended since the last pull; the number of bytes copied."""
        directory = self.session.ledger_dir
        ranks = self.remote()
        if not ranks or not os.path.isdir(directory):
            return 0
        if len(ranks) == 1:
            return self._pull_one(ranks[0], directory)
        return sum(_pool().map(lambda r: self._pull_one(r, directory), ranks))

    def _pull_one(self, rank: int, directory: str) -> int:
        from workbench.rank.control import TAIL_MAX, ask

        path = os.path.join(directory, f"rank{rank}.jsonl")
        copied = 0
        while True:
            offset = os.path.getsize(path) if os.path.exists(path) else 0
            reply = ask(self.cluster.controls[rank], "tail", ASK_S, path=path, offset=offset)
            if "data" not in reply:
                self._silent[rank] = time.monotonic()
                return copied
            data = base64.b64decode(reply["data"])
            if data:
                with open(path, "ab") as f:
                    f.write(data)
            copied += len(data)
            if len(data) < TAIL_MAX:
                return copied


_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    """One pool for every session's pulls (a notebook makes many sessions; their threads stay few)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=16, thread_name_prefix="wb-mirror"))
    return _POOL[0]


def mirror_before_poll(cluster: Any, session: Any) -> LedgerMirror:
    """Make the session's ledger reader pull remote ranks' ledgers before each poll."""
    mirror = LedgerMirror(cluster, session)
    reader = session._ledger_reader
    poll = reader.poll

    def mirrored_poll() -> int:
        mirror.pull()
        return poll()

    reader.poll = mirrored_poll
    return mirror
