"""What is read from a running capture: the ``Reads`` part of ``shard.Capture``.

An attach (``engine.Host``), the post-mortem watch (``triggers.Watched``) and the debug-server handler
(``debug_server.py``: ``snapshot``, ``files``, ``open_calls``) read the capture through these; Flight Recorder's
record completes the ledger from here (``fill_from_flight_recorder``, ``watch_flight_recorder``: the job's
thread, the writer and the watcher each call it). Its own module so that ``Capture`` (``shard.py``) stays small
enough to read whole; the attributes it reads are the ones ``Capture.__init__`` sets.
"""

from __future__ import annotations

import json
import time
from typing import Any

from workbench.job import guest, triggers
from workbench.job.api import takes as _takes
from workbench.rank import shard_format


class Reads:
    """The capture's state as its readers see it, and the Flight Recorder reads that fill its ledger."""

    @property
    def enabled(self) -> bool:
        return self.stopped is None and not self._closed

    # -- what an attach reads (``engine.Host``) ------------------------------------------------
    @property
    def attempt(self) -> int:
        """The launcher's restart count (torchelastic's), as the shard records it."""
        return int(self.doc.get("attempt", 0))

    @property
    def device(self) -> Any:
        """This rank's device, as its last point saw it (cpu until one saw CUDA)."""
        return self.ctx.device

    @property
    def latest(self) -> dict[str, Any] | None:
        """The last point's record (its rows), or None before the first."""
        latest = self._latest
        return json.loads(latest) if isinstance(latest, str) else latest

    @property
    def device_held(self) -> str | None:
        """Why the post mortem could not free this rank's device (its communicators' abort failed), else None."""
        return self.watch.device_held if self.watch is not None else None

    # -- what the post-mortem watch reads (``triggers.Watched``) -------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def ledger_path(self) -> str | None:
        """This rank's ledger file, None without a ledger."""
        return self._ledger.path if self._ledger is not None else None

    @property
    def job_excepthook(self) -> Any:
        """The excepthook the capture took over: what runs the job's own failure as it would have been."""
        return self._hook

    @property
    def objects(self) -> dict[str, Any]:
        """The last point's objects (not its tensors), the namespace a breakpoint's engines see. Held weakly where the
        capture attaches nothing post mortem (a point does not keep the job's model or state dict alive): what
        cannot be held weakly (a dict) is not kept, what was freed since is left out."""
        if not self._objects_weak:
            return dict(self._objects)
        out = {}
        for key, ref in self._objects.items():
            obj = ref()
            if obj is not None:
                out[key] = obj
        return out

    # -- what the debug-server handler reads, and Flight Recorder's complement of the ledger ----
    @_takes()
    def snapshot(self) -> dict[str, Any]:
        """What the debug-server handler answers: this rank's latest point (its rows) and open calls."""
        self.flush(5.0)
        return {"rank": self.rank, "world_size": self.world_size, "job": self.job, "status": self.doc["status"],
                "points": list(self.points), "latest": self.latest, "open_calls": self.open_calls()}

    @_takes()
    def files(self) -> dict[str, Any]:
        """This rank's whole shard as text (``?shard=1``): what ``fetch`` writes into a directory to read."""
        self.flush(5.0)
        out: dict[str, Any] = {"rank": self.rank, "files": {}}
        names = [shard_format.MANIFEST, shard_format.POINTS, shard_format.STACKS, f"rank{self.rank}.jsonl"]
        for name in names:
            try:
                out["files"][name] = (self.dir / name).read_text(errors="replace")
            except OSError:
                pass
        return out

    @_takes()
    def open_calls(self) -> list[dict[str, Any]]:
        """The collectives this rank started and saw no end of, read from its own ledger file, oldest first (Flight
        Recorder's record first fills what the calls ledger could not see: the rank may wait in one of those)."""
        if self._ledger is None:
            return []
        self.flush(5.0)  # the points' own reads first, each labelling its calls with its step
        self.fill_from_flight_recorder("while the rank waits", hang=True)
        return triggers.open_calls(triggers.ledger_reader(self._ledger.path))

    @_takes(0)
    def fill_from_flight_recorder(self, when: str, hang: bool = False, marked_only: bool = False) -> int:
        """Write into the ledger the collectives Flight Recorder recorded and the calls ledger did not (issued from
        C++); nothing is read while the ledger's numbers have no gap. Returns how many rows; a fault of its own is
        one line (``guest.py``) and the capture goes on without the complement."""
        if self._fr is None:
            return 0
        with self._fr_lock:  # the job's thread, the writer and the watcher: one reads, one says a fault, once
            fr = self._fr
            if fr is None:  # another thread's fault took it off meanwhile
                return 0
            try:
                return fr.fill(when, hang=hang, marked_only=marked_only)
            except Exception as exc:  # a boundary: the complement off, said once (its API changes are named)
                if self.strict:
                    raise
                self._fr = None
                if self._calls is not None:  # the calls it was to fill are recorded here again from now on
                    self._calls.flight_recorder = False
                guest.say(f"workbench: rank {self.rank}: Flight Recorder's record is no longer read: "
                          f"{guest.cause(exc)}; the calls ledger goes on without it")
                return 0

    @_takes(0)
    def watch_flight_recorder(self, still_for: float) -> int:
        """The post-mortem watcher's read (its own thread): once no group's count has moved for ``still_for``
        seconds and the ledger has gaps, the rank may wait inside a call only Flight Recorder saw: fill, its
        newest call left open."""
        if self._fr is None:
            return 0
        from workbench.rank import ledger_fr
        from workbench.rank.ledger import backend_seq

        counts = tuple(backend_seq(pg) for pg, _ in ledger_fr.groups())
        now = time.monotonic()
        if counts != self._fr_still[0]:
            self._fr_still = (counts, now)
            return 0
        if now - self._fr_still[1] < still_for:
            return 0
        return self.fill_from_flight_recorder("while the rank waits", hang=True)
