"""The workbench's own errors: each names the cause in one line a user can act on."""

from __future__ import annotations

from dataclasses import dataclass


class WorkbenchError(Exception):
    """Base of every error the workbench raises on purpose."""


class UnknownName(WorkbenchError, KeyError):
    """An unknown scenario, fix or step; the message lists the valid names."""

    def __init__(self, what: str, name: str, valid: list[str]):
        self.name, self.valid = name, valid
        super().__init__(f"unknown {what} {name!r}; valid: {', '.join(valid) or '(none)'}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class ClusterError(WorkbenchError):
    """The cluster cannot do what was asked (bad ranks, dead or busy engines, no GPUs)."""


class BundleError(WorkbenchError):
    """A bundle is missing, truncated, corrupt or written by a newer schema."""


# The failure kinds of a rank lost to the step: its engine died, or it is stopped (SIGSTOP, Ctrl-Z) and the
# controller dropped it after its missed heartbeats (alive, but no task reaches it until cluster.restart()).
LOST = ("died", "stopped")


@dataclass
class RankFailure:
    """What went wrong on one rank: an exception, a missed deadline, or a dead engine."""

    rank: int
    kind: str  # "error" | "timeout" | "died" | "stopped" (SIGSTOP: alive, dropped by the controller)
    error: str  # exception type, or the kind for timeouts and deaths
    message: str
    traceback: str = ""

    def line(self) -> str:
        return f"rank {self.rank} {self.kind}: {self.error}: {self.message}".rstrip(": ")


class RankErrors(WorkbenchError):
    """Some ranks failed; every failing rank's failure is kept, not only the first."""

    def __init__(self, failures: dict[int, RankFailure], values: dict | None = None):
        self.failures = failures
        self.values = values or {}
        lines = [f.line() for _, f in sorted(failures.items())]
        super().__init__(f"{len(failures)} rank(s) failed:\n  " + "\n  ".join(lines))
