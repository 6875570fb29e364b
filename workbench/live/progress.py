"""The live status line of a step that takes long, drawn in a terminal or a notebook cell.

A step that runs past a second shows, until it ends, which ranks are done and where the
others wait (``analysis/progress.py`` words it from the ledgers). The engines' wait loop
polls a callback anyway (``Engines.call(watch=...)``, every ``WATCH_EVERY_S``); the
session hands it a poll that feeds the status line, then the deadlock watch. The line reads
only the open calls (raw rows, no table), and redraws at most every ``EVERY_S`` or ten times
its own cost, whichever is longer, so a step with thousands of calls does not pay for being
watched. Where the line goes is a *sink*: a callable taking the line, and
``""`` when the step ended (clear it). A terminal rewrites one stderr line in place; stderr
that is no terminal (CI logs) gets a plain line at most every ``PLAIN_EVERY_S``; a notebook
gets one display that updates. Drawing is best effort: a sink that fails is dropped, the
step goes on.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from workbench.analysis.progress import status_line

AFTER_S = 1.0  # a step that ends sooner shows nothing
EVERY_S = 0.25  # redraw at most this often
PLAIN_EVERY_S = 5.0  # stderr that is no terminal: a plain line at most this often

Sink = Callable[[str], Any]  # shows a line; "" means the step ended: clear it


class StepLine:
    """One step's status line: notes when each rank returns, renders through ``sink`` once the step
    has run ``AFTER_S``, and clears it at ``close()`` (only if it ever showed)."""

    def __init__(self, sink: Sink, ranks: Iterable[int], read: Callable[[], Any], after: float | None = None,
                 every: float | None = None):
        self.sink: Sink | None = sink
        self.ranks, self.read = list(ranks), read  # read(): the step's open calls (rows or a ledger table)
        self.after = AFTER_S if after is None else after
        self.every = EVERY_S if every is None else every
        self.started = time.time()
        self.done: dict[int, float] = {}  # rank -> seconds its step took (to the poll that saw it)
        self.lines: list[str] = []  # what was shown, in order
        self._next = self.started + self.after

    def __call__(self, done: Iterable[int]) -> None:
        now = time.time()
        for r in done:
            self.done.setdefault(r, now - self.started)
        if self.sink is None or now < self._next:
            return
        try:
            line = status_line(self.read(), self.ranks, self.done, now, self.started)
            self.sink(line)
        except Exception:  # a boundary: a display (the user's sink, any widget) that cannot draw must not fail the step
            self.sink = None
            return
        self.lines.append(line)
        self._next = now + max(self.every, 10 * (time.time() - now))  # drawing costs at most ~10% of a core

    def close(self) -> None:
        if self.sink is not None and self.lines:
            try:
                self.sink("")
            except (OSError, ValueError):  # it drew before: only its stream can have closed since
                pass
        self.sink = None


def poll_with(line: StepLine | None, watch: Callable[[set[int]], str | None] | None
              ) -> Callable[[set[int]], str | None] | None:
    """The engines' poll callback: the status line, then the deadlock watch (whose reason, if any,
    ends the wait). None when neither is on: the engines poll nothing."""
    if line is None and watch is None:
        return None

    def poll(done: set[int]) -> str | None:
        if line is not None:
            line(done)
        return watch(done) if watch is not None else None

    return poll


class TerminalLine:
    """One line on a stream, rewritten in place on a terminal; elsewhere a plain line now and then."""

    def __init__(self, stream: TextIO | None = None, plain_every: float = PLAIN_EVERY_S):
        self.stream = sys.stderr if stream is None else stream
        self.plain_every = plain_every
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._shown = False
        self._first = self._last = None

    def __call__(self, line: str) -> None:
        if self._tty:
            width = shutil.get_terminal_size((120, 24)).columns - 1
            text = line if len(line) <= width else line[: max(width - 1, 0)] + "…"
            self.stream.write(("\r" + text + "\x1b[K") if line else ("\r\x1b[K" if self._shown else ""))
            self.stream.flush()
            self._shown = bool(line)
            return
        now = time.monotonic()
        self._first = self._first or now
        if line and now - self._first >= self.plain_every and (self._last is None or
                                                               now - self._last >= self.plain_every):
            self._last = now
            print(f"workbench: {line}", file=self.stream, flush=True)


class NotebookLine:
    """One output in the running cell, updated in place (an IPython display handle)."""

    def __init__(self) -> None:
        self._handle: Any = None

    def __call__(self, line: str) -> None:
        import html

        from IPython.display import display

        bundle = {"text/plain": line, "text/html": f"<code>{html.escape(line)}</code>" if line else ""}
        if self._handle is None:
            if line:
                self._handle = display(bundle, raw=True, display_id=True)
            return
        self._handle.update(bundle, raw=True)


def in_notebook() -> bool:
    """Running in a Jupyter kernel (not a terminal IPython, not a script)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def sink_for(progress: bool | Sink | None) -> Sink | None:
    """``True``: a notebook line in a kernel, else a stderr line; ``False``/``None``: none; a callable: itself."""
    if callable(progress):
        return progress
    if not progress:
        return None
    return NotebookLine() if in_notebook() else TerminalLine()
