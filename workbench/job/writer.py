"""The capture's writer: one thread that finishes each point (its rows' JSON, the shard's files, Flight Recorder's
record read for the calls up to it), so that on a GPU the job's thread hands a point over and goes back to its step.

Why a thread: on a GPU job the step's Python runs ahead of the device; whatever the point does on the job's
thread (serialising ~50 KB of rows, writing them, reading the whole Flight Recorder ring) is time the job's next
launches wait for. On the writer it runs while the GPU works (issue 46: a point every step within 3 % of a step).
Why not on CPU: there the job's thread is the CPU's work; a thread would only contend with it for the GIL, and a
point written in place is on disk before ``point`` returns, which a rank killed right after relies on.

A fault of the writer's is the capture's fault (one line, the capture off: ``guest.py``), said from this thread;
what the job's thread reads of the shard (close, a breakpoint, its exception, the debug server) waits for the
writer first (``drain``).
"""

from __future__ import annotations

import gc
import os
import queue
import threading
import weakref
from collections.abc import Callable

ENV = "WORKBENCH_CAPTURE_WRITER"  # "thread": the writer thread on any device (tests on CPU); "inline": never
DRAIN_S = 30.0  # the longest the job's thread waits for points still being written (close, a breakpoint)
LAG_S = 1.0  # the longest a launched point's rows wait for the next point to be handed over (``Writer.submit``)


def wanted(on_gpu: bool, strict: bool) -> bool:
    """Whether points are finished on the writer thread: on a GPU job by default, never in strict mode (its faults
    raise into the job at the point that caused them); ``WORKBENCH_CAPTURE_WRITER`` overrides the default."""
    from workbench.job.config import from_env

    how = from_env().writer or ""  # ENV through the config: a bad value is said by the capture, ignored here
    if strict or how == "inline":
        return False
    return how == "thread" or on_gpu


class GcHold:
    """Automatic collection held off while a point's rows live (its probe on the job's thread, its JSON on the
    writer's), as a live engine holds it while it probes (``rank/control.pause_gc``): a point makes thousands of
    rows, which would make a collection due, and a full collection of a process holding a transformers model takes
    0.2-0.3 s on an H200 host (``fixtures/gpu/real_size_gc.json``), landing in the job's next step. The rows die by
    refcount once written, so they never reach an old generation. Held by count (a point and its writing); a
    user's own ``gc.disable()`` before the first hold is left alone, and a process forked meanwhile (a DataLoader's
    worker) starts with collection on, as it would have."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds = 0
        self._ours = False
        _HOLDS.add(self)

    def hold(self) -> None:
        with self._lock:
            self._holds += 1
            if self._holds == 1 and gc.isenabled():
                gc.disable()
                self._ours = True

    def release(self) -> None:
        with self._lock:
            self._holds = max(0, self._holds - 1)
            if self._holds == 0 and self._ours:
                self._ours = False
                gc.enable()


_HOLDS: weakref.WeakSet = weakref.WeakSet()


def _child_after_fork() -> None:
    """In a forked child: whatever a hold of the parent's turned off is on again (the child has no writer)."""
    for h in list(_HOLDS):
        if h._ours:
            h._ours, h._holds = False, 0
            h._lock = threading.Lock()
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_child_after_fork)


class Writer:
    """Runs handed-over work in order on one daemon thread; ``drain`` waits until all of it has run."""

    def __init__(self, on_fault: Callable[[str, BaseException], None]):
        self._on_fault = on_fault
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._points = 0  # points handed over so far
        self._draining = 0  # threads waiting in ``drain``
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, where: str, work: Callable[[], None], *, point: bool = False, lag: bool = False) -> None:
        """Queue ``work``. ``point``: it finishes a point. ``lag``: it waits first until a later point is handed
        over, a drain starts, or ``LAG_S`` passed. Why: a GPU job that reads its loss each step finds its step's
        kernels, and a launched point's, done just as its thread starts launching the next step, with the device
        idle. The writer's Python (the rows, their JSON: 11-13 ms a point on an H200 host) then took the GIL from
        those launches: each torch call lets the GIL go and gets it back only after the writer's switch interval
        (5 ms), while the device waited for work. When the next point is handed over, the job's thread has just
        launched a whole step, the device is a step behind, and what the writer holds up is launches the device
        does not wait for yet."""
        with self._done:
            self._pending += 1
            if point:
                self._points += 1
                self._done.notify_all()
            mark = self._points if lag else None
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="workbench-capture-writer", daemon=True)
            self._thread.start()
        self._queue.put((where, work, mark))

    def _lag(self, mark: int) -> None:
        with self._done:
            self._done.wait_for(lambda: self._points > mark or self._draining > 0, LAG_S)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            where, work, mark = item
            try:
                if mark is not None:
                    self._lag(mark)
                work()
            except BaseException as exc:  # the capture's fault, never the job's
                try:
                    self._on_fault(where, exc)
                except BaseException:  # the thread must live on to drain: the fault was the capture's to say
                    pass
            finally:
                del item, work  # the point's rows die now, not when the next item arrives
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def drain(self, timeout: float = DRAIN_S) -> bool:
        """Wait until everything handed over has run (not from the writer's own thread); False on timeout."""
        if self._thread is None or threading.current_thread() is self._thread:
            return True
        with self._done:
            self._draining += 1
            self._done.notify_all()  # a point waiting for the next one is made now
            try:
                return self._done.wait_for(lambda: self._pending == 0, timeout)
            finally:
                self._draining -= 1

    def stop(self, timeout: float = DRAIN_S) -> bool:
        """Drain, then end the thread."""
        ok = self.drain(timeout)
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._queue.put(None)
            self._thread.join(1.0 if ok else 0.1)
            self._thread = None
        return ok
