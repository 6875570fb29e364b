"""What the capture holds for the whole process, in one object: the open capture, its automatic points, and the
capture a breakpoint or post mortem serves as an ipyparallel engine right now.

Why process-wide at all: a process runs one capture at a time (``capture()`` again returns the open one), c10d's
debug-server handler and the engine are singletons of the process, and the remote calls a notebook makes
(``cluster.probe``) must find the capture that serves here. Why one object: these were four module slots in four
modules, each cleared by its own rule; here each is set by the one that owns it and cleared only by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ProcessState:
    capture: Any = None  # the open capture (``shard.Capture``): set at install, cleared at its unwind
    hooks: Any = None  # its automatic points (``hooks.Hooks``): set at install, cleared at uninstall
    served: Any = None  # the capture serving as an engine now (``engine.Host``): during an attach only

    def open_capture(self) -> Any:
        """The capture open now, or None (a closed one is not)."""
        cap = self.capture
        return cap if cap is not None and not cap.closed else None

    def release(self, slot: str, owner: Any) -> None:
        """Clear ``slot`` if ``owner`` still holds it (a later owner's is left alone)."""
        if getattr(self, slot) is owner:
            setattr(self, slot, None)


STATE = ProcessState()
