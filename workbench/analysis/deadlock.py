"""A deadlock read from the ledgers while a step still runs: declared by content, not by a timeout.

The ranks append every collective to their ledger before they enter it, so the client can
see who is blocked where while nobody answers. When every rank of a group that has not
finished the step sits in an open collective and those calls cannot pair (different op,
call number, dtype or size), or a rank already finished the step while a peer waits for it
in a collective it will never issue, nothing can make progress: the hang is certain and
waiting out a deadline only costs time. ``Watch`` adds the one safeguard content cannot give:
the same picture must hold for a short while, because a mismatched pair that the backend
completes anyway (NCCL returns a mis-sized broadcast silently) is a corruption, not a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from workbench.analysis.collectives import OPEN, describe, group_ranks, mismatch_kind
from workbench.rank import waitfor


@dataclass
class Deadlock:
    """Who waits where, and why those calls can never complete."""

    group: str
    waiting: dict[int, dict[str, Any]]  # rank -> its open call on the group
    finished: dict[int, dict[str, Any] | None] = field(default_factory=dict)  # rank -> its last call, done
    reason: str = ""

    @property
    def signature(self) -> tuple:
        return (self.group, tuple(sorted((r, c.get("seq")) for r, c in self.waiting.items())),
                tuple(sorted(self.finished)))

    def __str__(self) -> str:
        return self.reason


# A peer's call that ended this way (a release, a timeout) took no part in a later call of the same number:
# on a mesh, a released waiter's group goes on to the next step, where its peers issue that number late.
ENDED_UNPAIRED = ("failed", "timed out")


def _first_open(part: pd.DataFrame) -> dict[str, Any] | None:
    open_ = part[part["state"] == OPEN]
    if open_.empty:
        return None
    return dict(open_.sort_values("seq").iloc[0])


def find(ledger: pd.DataFrame, done: Iterable[int], ranks: Iterable[int]) -> Deadlock | None:
    """The deadlock among this step's calls, or None while progress is still possible.

    ``ledger``: the step's calls (one attempt); ``done``: ranks whose step call returned;
    ``ranks``: every rank running the step. On a mesh, groups that share no rank can deadlock each on its
    own: every such proof is one ``Deadlock`` (its waiters all of theirs, its reason each proof in turn), so
    one release frees them all instead of leaving the second group to the collective timeout.
    """
    found = _each(ledger, done, ranks)
    if len(found) <= 1:
        return found[0] if found else None
    # A peer that finished without the waiters' call number lets the release skip its hold; call numbers of
    # different groups do not compare, so the merged proof keeps its finished peers only when each part has one.
    finished = ({r: c for d in found for r, c in d.finished.items()} if all(map(_first_sight, found)) else {})
    return Deadlock(",".join(d.group for d in found), {r: c for d in found for r, c in d.waiting.items()},
                    finished, "; and ".join(d.reason for d in found))


def _first_sight(d: Deadlock) -> bool:
    """A finished peer never issued the waiters' call number (``live/release.certain``'s rule, per group)."""
    seqs = [int(c["seq"]) for c in d.waiting.values()]
    return bool(d.finished) and bool(seqs) and all(last is None or int(last["seq"]) < min(seqs)
                                                    for last in d.finished.values())


def _each(ledger: pd.DataFrame, done: Iterable[int], ranks: Iterable[int]) -> list[Deadlock]:
    """Every group's own deadlock proof (``find``), on groups whose waiters are not already in one."""
    done, ranks = set(done), set(ranks)
    waiting_ranks = ranks - done
    if not waiting_ranks or ledger is None or ledger.empty:
        return []
    open_by_rank: dict[int, dict[str, Any]] = {}
    for r in waiting_ranks:
        call = _first_open(ledger[ledger["rank"] == r])
        if call is None:
            return []  # a rank still computing (or in no collective): it may yet issue the call
        open_by_rank[r] = call
    out: list[Deadlock] = []
    for group, part in ledger.groupby("group", sort=True):
        d = _group_deadlock(str(group), part, open_by_rank, done, ranks)
        if d is not None and not set(d.waiting) & {r for x in out for r in x.waiting}:
            out.append(d)
    if not out:
        d = _across_groups(ledger, open_by_rank, ranks)
        out += [d] if d is not None else []
    return out


def _across_groups(ledger: pd.DataFrame, open_by_rank: dict[int, dict[str, Any]], ranks: set[int]) -> Deadlock | None:
    """Waiters blocked on each other across groups (a recv on the channel 0:1->0 against a barrier on group 0):
    each waits in a call for a member of that call's group who waits in another call, in a cycle, so none of
    those calls can ever complete (``job/triggers._prove``'s rule, on the live ledgers). No group proves it
    alone: every group holds a member blocked elsewhere."""
    members = {str(g): set(group_ranks(part)) & ranks for g, part in ledger.groupby("group", sort=True)}

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return str(a["group"]) == str(b["group"]) and int(a["seq"]) == int(b["seq"]) and not mismatch_kind(a, b)

    waits = {r: [p for p in sorted(members.get(str(c["group"]), set())) if p != r and p in open_by_rank
                 and not same(c, open_by_rank[p])] for r, c in open_by_rank.items()}
    cycle = waitfor.cycle(waits)
    if not cycle:
        return None
    here = {r: open_by_rank[r] for r in cycle}
    pairs = "; ".join(f"rank {r} waits in {describe(c)} on group {c['group']} for rank(s) "
                      f"{','.join(map(str, waits[r]))}" for r, c in sorted(here.items()))
    groups = ",".join(sorted({str(c["group"]) for c in here.values()}))
    return Deadlock(groups, here, {}, f"the open calls wait on each other across groups: {pairs}")


def _group_deadlock(group: str, part: pd.DataFrame, open_by_rank: dict[int, dict[str, Any]], done: set[int],
                    ranks: set[int]) -> Deadlock | None:
    """The proof that the waiters on ``group`` can never complete, or None."""
    members = set(group_ranks(part)) & ranks
    here = {r: c for r, c in open_by_rank.items() if str(c.get("group")) == str(group) and r in members}
    if not here:
        return None
    r0, c0 = min(here.items(), key=lambda kv: kv[0])
    seq = int(c0["seq"])
    # a finished member never issues the call its peers wait in
    for q in sorted(members & done):
        mine = part[part["rank"] == q]
        last = dict(mine.sort_values("seq").iloc[-1]) if len(mine) else None
        if last is None or int(last["seq"]) < seq:
            upto = f"after {describe(last)}" if last else "without a call on this group"
            return Deadlock(str(group), here, {q: last},
                            f"rank {q} finished the step {upto}; rank {r0} waits in {describe(c0)}, "
                            f"which rank {q} will never issue")
        same = mine[mine["seq"] == seq]
        theirs = dict(same.iloc[0]) if len(same) else None
        if theirs is not None and theirs["state"] in ENDED_UNPAIRED:
            return Deadlock(str(group), here, {q: last},
                            f"rank {q} finished the step; its call #{seq} ({describe(theirs)}) already "
                            f"{theirs['state']}, so rank {r0}'s {describe(c0)} has no peer left to pair with")
        if theirs is not None and mismatch_kind(theirs, c0):
            return Deadlock(str(group), here, {q: last},
                            f"rank {q} finished the step; its call #{seq} was {describe(theirs)}, while rank "
                            f"{r0} waits in {describe(c0)}: they cannot pair, and rank {q} issues nothing more")
    if set(here) != members:
        return None  # some member is blocked elsewhere: not provable from this group alone
    for r, c in here.items():
        if r == r0:
            continue
        if int(c["seq"]) != seq or mismatch_kind(c, c0):
            pairs = "; ".join(f"rank {x}: {describe(y)}" for x, y in sorted(here.items()))
            return Deadlock(str(group), here, {}, f"the open calls on group {group} cannot pair: {pairs}")
    return None


class Watch:
    """Polls a ledger source during a step and declares a deadlock once it has held for ``hold`` s."""

    def __init__(self, read: Any, ranks: list[int], hold: float = 0.3,
                 hold_for: Callable[[Deadlock], float] | None = None):
        self.read, self.ranks, self.hold = read, ranks, hold
        self.hold_for = hold_for  # per picture (a peer that finished without the call needs no hold)
        self._seen: tuple | None = None
        self._since = 0.0
        self.found: Deadlock | None = None
        self.blocked_at: float | None = None  # ledger time the last rank entered its open call

    def forget(self) -> None:
        """Nothing open now: a picture seen before must be seen anew to count."""
        self._seen = None

    def __call__(self, done: Iterable[int]) -> str | None:
        d = find(self.read(), done, self.ranks)
        now = time.monotonic()
        if d is None:
            self._seen = None
            return None
        if d.signature != self._seen:
            self._seen, self._since = d.signature, now
            return None
        if now - self._since < (self.hold_for(d) if self.hold_for is not None else self.hold):
            return None
        self.found = d
        starts = [c.get("t_start") for c in d.waiting.values() if c.get("t_start") is not None]
        self.blocked_at = max(starts) if starts else None
        return d.reason
