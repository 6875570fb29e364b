"""A deadlock declared from the ledgers releases only the calls that can never complete.

``analysis/deadlock.find`` proves a deadlock while the step still runs (on every backend: the
ledgers are written before each call enters the backend). Ending the whole step there, as the
step deadline does, would also cut short the ranks that are not stuck: in the headline incident
rank 1 has already received rank 0's fp32 bytes into its bf16 bucket and finished the wrap,
while rank 0 waits in a second broadcast that rank 1 will never post. So the watch here asks
only the waiting ranks' control threads to abort (gloo: shut down that rank's group sockets;
NCCL: abort its communicators); their calls raise, their steps return like any failed
collective, the probe sees what they hold, and the finished ranks' results stand. The frame
names each released call and the proof.

The picture must hold ``HOLD_S`` first: a mis-sized pair the backend completes anyway (gloo
accepts a short message into a larger receive, NCCL a mis-sized broadcast) is a corruption,
not a hang. Only a peer that finished the step without ever issuing the waiter's call number
is declared at first sight (``certain``): nothing on the wire can pair with that call. A rank
the abort does not free within ``RELEASE_WAIT_S`` ends the wait the old way (its call stays
open, ``recover()`` brings it back).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from workbench.analysis import deadlock
from workbench.analysis.collectives import describe

if TYPE_CHECKING:
    import pandas as pd

    from workbench.live.engines import Engines

HOLD_S = 0.3  # the same deadlock seen for this long is declared
RELEASE_WAIT_S = 5.0  # released ranks that have not returned by then end the wait as stuck


def certain(d: deadlock.Deadlock) -> bool:
    """A peer that finished the step without ever issuing the waiter's call number: no backend can complete
    that call (nothing is on the wire to pair with), so no hold is needed. A mis-sized or other-op pair can
    still complete on some backends, and open calls on both sides may yet move: those wait ``HOLD_S``."""
    if not d.finished:
        return False
    seqs = [int(c["seq"]) for c in d.waiting.values()]
    return bool(seqs) and all(last is None or int(last["seq"]) < min(seqs) for last in d.finished.values())


class Release:
    """The engines' poll callback during a step: declare a proven deadlock, release its waiters."""

    def __init__(self, cluster: Engines, read: Callable[[], pd.DataFrame], ranks: list[int],
                 hold: float = HOLD_S, any_open: Callable[[], bool] | None = None):
        self.cluster, self.ranks = cluster, ranks
        self.any_open = any_open  # cheap check first: no open call, no table built (most polls of most steps)
        self._watch = deadlock.Watch(read, ranks, hold, hold_for=lambda d: 0.0 if certain(d) else hold)
        self.found: deadlock.Deadlock | None = None
        self.blocked_at: float | None = None  # ledger time the last waiting rank entered its call
        self.declared_at: float | None = None  # wall time the deadlock was declared (before any release)
        self.stacks: dict[int, str] = {}  # each waiting rank's stacks, taken while it sat in the call
        self.released: dict[int, str] = {}  # rank -> the call released, in words
        self.replies: dict[int, Any] = {}  # rank -> its control thread's answer to the abort
        self._released_mono: float | None = None

    def __call__(self, done: Iterable[int]) -> str | None:
        if self.found is not None:  # released: wait for the waiters to return, not for ever
            if time.monotonic() - (self._released_mono or 0) > RELEASE_WAIT_S:
                return f"{self.found.reason} (the release did not free rank(s) {sorted(self.found.waiting)})"
            return None
        if self.any_open is not None and not self.any_open():
            self._watch.forget()
            return None
        if self._watch(done) is not None:
            self._declare(self._watch.found)
        return None

    def _declare(self, d: deadlock.Deadlock) -> None:
        self.found, self.declared_at = d, time.time()
        self.blocked_at = self._watch.blocked_at
        waiting = sorted(d.waiting)
        self.stacks = self.cluster.stacks(waiting)  # while they still sit in the call
        with ThreadPoolExecutor(max_workers=min(32, len(waiting))) as pool:
            # Mark every waiter first: a waiter whose peer's abort frees it must still put it down to us.
            list(pool.map(lambda r: self.cluster.control(r, "mark"), waiting))
            self.replies = dict(zip(waiting, pool.map(lambda r: self.cluster.control(r, "abort"), waiting)))
        self.released = {r: describe(c) for r, c in sorted(d.waiting.items())}
        self._released_mono = time.monotonic()

    def notes(self) -> dict[int, list[str]]:
        """What each rank's frame says: the call released on it and why, or that it went on."""
        if self.found is None:
            return {}
        out: dict[int, list[str]] = {}
        for r in self.ranks:
            if r in self.released:
                reply = self.replies.get(r) or {}
                how = "; ".join(reply.get("did") or []) or reply.get("why") or reply.get("error") or ""
                out[r] = [f"deadlock declared from the ledgers: the workbench released {self.released[r]}, which "
                          f"could never complete ({self.found.reason})" + (f" [{how}]" if how else "")]
            else:
                out[r] = ["deadlock declared from the ledgers on other ranks; this rank was not stuck and its "
                          "step ran as it would have"]
        return out

    @property
    def latency(self) -> float | None:
        """Seconds from the last rank blocking to the declaration (the ledger's clock and ours: one host)."""
        if self.declared_at is None or self.blocked_at is None:
            return None
        return self.declared_at - self.blocked_at
