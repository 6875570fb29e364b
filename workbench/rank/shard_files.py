"""A rank's folder as a capture opens it: what the run before left there kept aside, the points file, the ledger.

Standard library at import (``job/shard.py`` imports it, and a client that never captures must not import torch).

The capture (``job/shard.py``) hands its directory here once and keeps what comes back; the names inside the
folder are the shard format's (``shard_format.py``, which the reader imports too). Every file opened and every
wrapper installed puts its undo on the caller's stack, the moment it is opened or installed, so that a step that
fails leaves nothing of the steps before it, and the capture's close undoes them with everything else it
installed, last first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.rank import shard_format

if TYPE_CHECKING:
    from workbench.rank.ledger import Ledger


class RankFiles:
    """Open rank ``rank``'s folder under ``root``. ``ledger``: ``"calls"`` (around ``torch.distributed``'s
    collective functions, completed by PyTorch's Flight Recorder for what C++ issues: ``ledger_fr.Complement``),
    ``True``/``"full"`` (every collective this thread issues, through a dispatch mode) or falsy (none).
    ``fault``: where a fault inside the ledger's hooks goes (None: it raises there, ``strict``); ``before_destroy``:
    what to read before the job destroys its process groups (Flight Recorder's record, on every rank)."""

    def __init__(self, root: Path, rank: int, stack: contextlib.ExitStack, *, ledger: bool | str, session: str,
                 attempt: int, fault: Callable[[BaseException], None] | None,
                 before_destroy: Callable[[], None]) -> None:
        self.dir = shard_format.rank_dir(root, rank)
        keep_previous(root, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.points = open(self.dir / shard_format.POINTS, "a", buffering=1)
        stack.callback(self.points.close)
        self.ledger: Ledger | None = None
        self.calls: Any = None  # the calls ledger (``ledger_calls.CallLedger``), where ledger="calls"
        self.fr: Any = None  # Flight Recorder's complement of the calls ledger (``ledger_fr.Complement``)
        if ledger:
            self._ledger(rank, stack, ledger, session, attempt, fault, before_destroy)

    def _ledger(self, rank: int, stack: contextlib.ExitStack, how: bool | str, session: str, attempt: int,
                fault: Callable[[BaseException], None] | None, before_destroy: Callable[[], None]) -> None:
        from workbench.rank import ledger as ledger_mod  # torch: imported only by a capture that records (the
        # module is imported wherever ``job/shard.py`` is, and that stays free of torch until a capture opens)

        book = self.ledger = ledger_mod.Ledger(str(self.dir), rank, session=session, attempt=attempt)
        stack.callback(book.close, settle_later=True)  # calls still running end later
        if fault is not None:
            book.guest = fault
        book.step = "0"  # calls on the way to point 0; the reader names them after it
        if how != "calls":
            stack.callback(ledger_mod.start_recording(book, "0"))
            return
        # around the job's collective calls only: no per-op cost, torch.compile compiles
        from workbench.rank.ledger_calls import CallLedger
        from workbench.rank.ledger_fr import Complement, records, switch_on

        self.calls = CallLedger(book)
        stack.callback(self.calls.uninstall)
        self.calls.install()
        switch_on()  # where no process group exists yet and the job set no buffer size of its own
        self.calls.flight_recorder = records()  # NCCL's hot calls then pass to its record (ledger_calls.FR_OPS)
        self.fr = Complement(book)
        # A job that destroys its groups before the capture closes: their record is read there, on every rank (at
        # close there is nothing left to read, and a rank whose hang watcher had read it while the rank lingered
        # would be the only one to hold its last calls).
        stack.callback(ledger_mod.before_destroy(before_destroy))


def keep_previous(root: Path, rank: int) -> None:
    """This rank's shard of the run before (an elastic restart's earlier attempt, a rerun into the same
    directory) moves to ``<root>/previous/rank<r>``, which opens as shards of its own; the one before
    that goes."""
    here = shard_format.rank_dir(root, rank)
    if not (here / shard_format.MANIFEST).exists():
        return
    prev = shard_format.rank_dir(root / "previous", rank)
    shutil.rmtree(prev, ignore_errors=True)
    prev.parent.mkdir(parents=True, exist_ok=True)
    os.replace(here, prev)
