"""One way to put a wrapper over torch and take it off again: what the automatic points (``job/hooks.py``) and the
detectors (``job/materialise.py``, ``job/losses.py``) each did by hand; the ledger's wrappers are ``unseen`` too.

Why an undo that checks: between install and close the job (or another tool: a profiler, a second wrapper) may have
put its own function over ours. Taking ours off then would throw theirs away, so the undo restores the original only
while ours is still the one there, and otherwise leaves theirs (ours then stays inside it, passing through).

Why ``unseen``: a wrapper is one more frame between the job's line and torch's function, and torch names the job's
line in its warnings by counting frames (``warnings.warn(..., stacklevel=2)``): through a wrapper a Lightning
Fabric job printed "workbench/job/hooks.py:264: FutureWarning" where its plain run printed its own line.
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


UNSEEN = " (a workbench wrapper: warnings pass over it, as over importlib._bootstrap)"


def unseen(fn: Any) -> Any:
    """``fn`` (a wrapper, a plain function) with its code's file named so that ``warnings.warn`` passes over its
    frame when it counts ``stacklevel``: CPython skips a frame whose file's name holds both "importlib" and
    "_bootstrap" (its import machinery's), so a warning from inside the call it wraps names the job's line, as
    without the workbench. The name still starts with the real path (tracebacks read its lines through the
    module's loader; path rules, as torch.compile's, see the same file)."""
    code = getattr(fn, "__code__", None)
    if code is not None and not code.co_filename.endswith(UNSEEN):
        fn.__code__ = code.replace(co_filename=code.co_filename + UNSEEN)
    return fn


def replace(owner: Any, name: str, new: Any, old: Any | None = None) -> Callable[[], None]:
    """Set ``owner.name`` to ``new`` (``unseen`` by warnings); returns the undo, which puts ``old`` (default: what
    was there) back only while ``new`` is still there."""
    old = original(owner, name) if old is None else old
    setattr(owner, name, unseen(new))

    def undo() -> None:
        if current(owner, name) is new:
            setattr(owner, name, old)

    return undo
