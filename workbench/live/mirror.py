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

ASK_S = 1.0  # one control round trip to a remote rank while a step runs; one that misses it is skipped a while
SKIP_S = 5.0  # how long an unanswering rank is left out (an unreachable host must not slow every poll)
SETTLE_S = 10.0  # a pull once the step has ended: what the diagnosis reads must hold every rank's calls


class LedgerMirror:
    """Copies remote ranks' ledger files of one session into the client's ledger dir."""

    def __init__(self, cluster: Any, session: Any):
        self.cluster, self.session = cluster, session
        self._silent: dict[int, float] = {}  # rank -> when it last failed to answer
        self._unsettled: dict[int, int] = {}  # rank -> the step (session.steps_begun) whose settling pull it missed

    def remote(self, settle: bool = False) -> list[int]:
        """The remote ranks to ask. While a step runs, one that just missed a round trip is left out a while
        (polls come every few hundred ms); once it has ended, every rank is asked again, with a longer wait,
        until one misses that too (a host that is gone costs one wait a step, not one a read)."""
        now = time.monotonic()
        return [r for r in range(self.cluster.world_size) if not self.cluster.is_local(r)
                and self.cluster.controls.get(r)
                and (self._unsettled.get(r) != self._step() if settle
                     else now - self._silent.get(r, -SKIP_S) >= SKIP_S)]

    def _step(self) -> int:
        return int(getattr(self.session, "steps_begun", 0))

    def pull(self, settle: bool = False) -> int:
        """Copy what the remote ranks appended since the last pull; the number of bytes copied. ``settle``: the
        step has ended, so this copy is what the frame and the diagnosis will read."""
        directory = self.session.ledger_dir
        ranks = self.remote(settle)
        if not ranks or not os.path.isdir(directory):
            return 0
        wait = SETTLE_S if settle else ASK_S
        if len(ranks) == 1:
            return self._pull_one(ranks[0], directory, wait, settle)
        return sum(_pool().map(lambda r: self._pull_one(r, directory, wait, settle), ranks))

    def _pull_one(self, rank: int, directory: str, wait: float = ASK_S, settle: bool = False) -> int:
        from workbench.rank.control import TAIL_MAX, ask

        path = os.path.join(directory, f"rank{rank}.jsonl")
        copied = 0
        while True:
            offset = os.path.getsize(path) if os.path.exists(path) else 0
            reply = ask(self.cluster.controls[rank], "tail", wait, path=path, offset=offset)
            if "data" not in reply:
                self._silent[rank] = time.monotonic()
                if settle:
                    self._unsettled[rank] = self._step()
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
        mirror.pull(settle=not getattr(session, "stepping", False))
        return poll()

    reader.poll = mirrored_poll
    return mirror
