"""Every key the capture's ranks share through the job's own c10d store, and how long a rank waits for one.

Why one place: the breakpoint (``engine.py``), the post mortem (``triggers.py``) and the loss watch (``losses.py``)
write keys other ranks poll or wait for; a name spelt twice, or waited on with another timeout, is a rank that
never sees what its peer said. Keys live under the launcher's attempt (an elastic restart keeps its store and the
keys of the attempt before).
"""

from __future__ import annotations

from dataclasses import dataclass

JOB = "workbench/job"  # the job id every rank reads the same (the first to ask writes it)
NONFINITE_LOSS = "workbench/nonfinite_loss"  # the backward after which every rank takes the nonfinite_loss point

INFO_WAIT_S = 120.0  # a rank waits for rank 0's controller address (plus the attach's deadline)
DONE_WAIT_S = 60.0  # rank 0 waits for every rank's engine to stop serving before it stops the controller
CLOSED_WAIT_S = 30.0  # a served rank waits for rank 0 to close the attach before it goes on (the launcher would
CLOSED_AFTER_DEADLOCK_S = 60.0  # end the rest); after a proven deadlock, before it ends itself (slower: an abort)


@dataclass(frozen=True)
class Attach:
    """One attach's keys (a breakpoint's or the post mortem's)."""

    root: str

    def __str__(self) -> str:
        return self.root

    @property
    def info(self) -> str:
        """Rank 0's controller address for the others."""
        return self.root

    @property
    def go(self) -> str:
        """The trigger: why every rank serves (an error, a proven deadlock)."""
        return f"{self.root}/go"

    @property
    def claim(self) -> str:
        """Counted up by each rank that would trigger: the first (1) does."""
        return f"{self.root}/claim"

    @property
    def closed(self) -> str:
        """Set by rank 0 once the controller is stopped and ``attach.json`` says so."""
        return f"{self.root}/closed"

    def rank(self, r: int) -> str:
        """Rank ``r``'s part of the account (its role, where it stood, its open calls)."""
        return f"{self.root}/rank/{r}"

    def open(self, r: int) -> str:
        """Rank ``r``'s calls open past ``hang_after`` (what rank 0's deadlock proof reads)."""
        return f"{self.root}/open/{r}"

    def done(self, r: int) -> str:
        """Rank ``r``'s engine stopped serving."""
        return f"{self.root}/done/{r}"


def _attempt(attempt: int) -> str:
    return f"workbench/attempt{attempt}"


def post_mortem(attempt: int) -> Attach:
    return Attach(f"{_attempt(attempt)}/post-mortem")


def breakpoint(attempt: int, n: int) -> Attach:
    return Attach(f"{_attempt(attempt)}/breakpoint/{n}")
