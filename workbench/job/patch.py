"""One way to put a wrapper over torch and take it off again: what the automatic points (``hooks.py``) and the
detectors (``materialise.py``, ``losses.py``) each did by hand.

Why an undo that checks: between install and close the job (or another tool: a profiler, a second wrapper) may have
put its own function over ours. Taking ours off then would throw theirs away, so the undo restores the original only
while ours is still the one there, and otherwise leaves theirs (ours then stays inside it, passing through).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def current(owner: Any, name: str) -> Any:
    """What ``owner.name`` is now: a class's own attribute (not an inherited one), a module's attribute."""
    return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)


def original(owner: Any, name: str) -> Any:
    """What a wrapper of ``owner.name`` wraps: the class's own attribute where it has one (a ``staticmethod`` stays
    one), else what it inherits."""
    if isinstance(owner, type) and name in owner.__dict__:
        return owner.__dict__[name]
    return getattr(owner, name)


def replace(owner: Any, name: str, new: Any, old: Any | None = None) -> Callable[[], None]:
    """Set ``owner.name`` to ``new``; returns the undo, which puts ``old`` (default: what was there) back only while
    ``new`` is still there."""
    old = original(owner, name) if old is None else old
    setattr(owner, name, new)

    def undo() -> None:
        if current(owner, name) is new:
            setattr(owner, name, old)

    return undo
