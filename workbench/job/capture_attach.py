"""What serves after the capture: the ``Attach`` part of ``shard.Capture``.

``breakpoint`` serves every rank as an ipyparallel engine (``engine.py``); ``post_mortem`` and the exception hook
the capture puts in the job (``_excepthook``: the job's exception as one line of the shard, the traceback printed
at once, then the post mortem of ``triggers.py``) serve after a failure. Its own module so that ``Capture``
(``shard.py``) stays small enough to read whole; the attributes it reads are the ones ``Capture.__init__`` and
``_install`` set.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from typing import Any

from workbench.job import engine, guest, triggers
from workbench.job.api import takes as _takes


class Attach:
    """A breakpoint, a post mortem asked for in an ``except``, and the exception hook (taken over at install,
    given back at close)."""

    @_takes(lambda: {"by": "off", "seconds": 0.0})
    def breakpoint(self, *, deadline: float = 600.0, controller: str | os.PathLike | None = None,
                   **objects: Any) -> dict[str, Any]:
        """Every rank (at the same point) serves as an ipyparallel engine until ``cluster.resume()`` from a
        client (``wb.connect(job=<this capture's dir>)``) or ``deadline`` seconds; then the script goes on with
        whatever the notebook changed. The engines see ``objects``, the last point's objects and ``cap``
        (``workbench/job/engine.py`` says how it returns)."""
        if not self._usable():
            return {"by": "off", "seconds": 0.0}
        self.flush()
        return engine.serve(self, deadline=deadline, controller=controller, **objects)

    @_takes()
    def post_mortem(self, exc: BaseException | None = None) -> dict[str, Any] | None:
        """In an ``except`` that ends the rank without the exception reaching ``sys.excepthook`` (a
        ``sys.exit(1)`` after logging): serve every rank post mortem for ``exc`` (default: the one being
        handled), as ``capture(attach="on-error")`` does for an uncaught one. Returns how it ended."""
        if not self._usable():
            return None
        exc = exc if exc is not None else sys.exc_info()[1]
        if exc is None:
            raise ValueError("cap.post_mortem() needs an exception: call it in an except block, or pass one")
        if self.watch is None or "error" not in self.watch.triggers:
            raise ValueError("cap.post_mortem() needs the capture's attach='on-error' (or 'post-mortem') on "
                             "every rank: their threads serve the ranks that did not raise")
        self.flush()
        return triggers.on_exception(self, self.watch, exc, exc.__traceback__)

    def _excepthook(self, kind: type, exc: BaseException, tb: Any) -> None:
        if getattr(self, "_telling", False):  # ``_tell`` runs the hooks around this one: print, as the job's hook
            self._hook(kind, exc, tb)
            return
        # the post mortem stopped this waiting rank (or its aborted communicators raised): not the job's error
        released = isinstance(exc, triggers.Released) or triggers.was_released(self.watch)
        if self.stopped is None and not self._closed:
            try:
                self.flush()
                self.fill_from_flight_recorder("at the job's exception")  # its own fault is its own line
                from workbench.rank.ledger import traceback_text

                text = traceback_text(exc) if exc is not None else "".join(traceback.format_exception(kind, exc, tb))
                self._points_file.write(json.dumps({
                    "kind": "error", "index": len(self.points), "t": time.time(), "error": kind.__name__,
                    "message": str(exc)[:2000], "traceback": text[-6000:],
                    **({"released": True} if released else {})}) + "\n")
                self._points_file.flush()
                self.doc["status"] = "released" if released else "raised"
                self._write_manifest()
            except Exception as hook_exc:  # one line, then the job's own exception as it would have been
                self._fault("recording the job's exception", hook_exc)
        # the traceback at once, as Python would print it, before any wait for a notebook; and only once
        told = not released and not self._closed and triggers.may_wait(self.watch, exc)
        if told:
            self._tell(kind, exc, tb)
        if self.watch is not None and not self._closed:
            try:
                triggers.on_exception(self, self.watch, exc, tb, told=told)
            except KeyboardInterrupt:  # Ctrl-C (the launcher passes it on) ended the wait: the job fails now
                pass
            except BaseException as pm_exc:  # never in the way of the job's own failure
                guest.say(f"workbench: rank {self.rank}: the post-mortem attach failed: {guest.cause(pm_exc)}")
        if released:  # it waited above until the attach was over; the rank ends with one line, exit status 1
            with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed, full or absent stderr
                sys.__stderr__.write(triggers.released_line(self.rank, self.watch, exc))
                sys.__stderr__.flush()
            return
        if not told:
            self._hook(kind, exc, tb)

    def _tell(self, kind: type, exc: BaseException, tb: Any) -> None:
        """What the job would have printed for ``exc``, now, before the post mortem waits rather than after it.

        The whole chain of excepthooks runs, not only the one the capture took over: a hook set after the capture's
        may wrap it and hold what it prints until it returns (``init_process_group``'s own puts a ``[rank1]:``
        before each line, printing into a buffer meanwhile). So the outermost hook runs again here, on the
        process's own stderr, and the capture's hook, called inside it, only prints (``_telling``)."""
        held = sys.stderr
        self._telling = True
        try:
            if isinstance(held, io.StringIO):  # inside a wrapping hook that buffers: the real stream for this one
                sys.stderr = sys.__stderr__
            outer = sys.excepthook if sys.excepthook is not self._excepthook else self._hook
            outer(kind, exc, tb)
        except Exception:  # the job's own hook failed: Python's prints the job's failure instead
            with contextlib.suppress(Exception):  # an excepthook never raises
                sys.__excepthook__(kind, exc, tb)
        finally:
            self._telling = False
            sys.stderr = held
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed, full or absent stderr
            sys.__stderr__.flush()

    def _give_back_excepthook(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._hook
