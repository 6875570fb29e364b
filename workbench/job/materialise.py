"""Every ``to_empty``: what was real before the call and what the call handed back (*clobbered* tensors).

Stacks materialise meta-built models in their own ways: ``model.to_empty(device=...)`` once, or (Megatron-FSDP
0.6.1, ``param_and_grad_buffer.py``) ``m.to_empty(device=..., recurse=False)`` on every module followed by
``m.reset_parameters()``, which rewrites parameters only. ``to_empty`` replaces every tensor it reaches, meta or
not: a buffer registered with an explicit device inside ``with torch.device("meta")`` (Megatron's router
``expert_bias``, zeros) is real before the call and uninitialised memory after it (incident 001). So every call,
root or not, ``recurse`` or not, is watched here: the tensors that were real before it and that it replaced are
kept (their module, local name, how they read before, the library's line that called ``to_empty`` and the user's
line), and a point that probes a module holding them names them by their path from that module with a note::

    clobbered: `layers.0.router.expert_bias` was real (zeros) before `to_empty(recurse=False)` at
    megatron_fsdp/param_and_grad_buffer.py:2902, called from train.py:57, and was replaced by memory nobody wrote

The diagnosis leads with that note (``workbench.analysis.findings.clobbered``). Everything here is a guest: the
call's arguments, return value and the tensors it made are the stack's own; a fault of the watch is a line in the
shard's ``hook_errors`` and the call goes on untouched. The cost is per ``to_empty`` call, at initialisation only:
the module's real tensors (in a meta-built model, the few made with an explicit device) are named and read
(zeros? their first values; one past a million elements only counted); nothing is held past the call.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workbench.rank import patch

NOTE = "clobbered: "  # the note's head: what the diagnosis looks for
_WORKBENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MARK = "__workbench_materialise__"
_READ = 1 << 20  # a real tensor up to this many elements is read before to_empty (zeros? its first values)


@dataclass
class Clobber:
    """One tensor ``to_empty`` replaced although it was real: where it lives and how it read before."""

    module: weakref.ref
    name: str  # local to the module to_empty was called on (dotted with recurse=True)
    before: str  # "zeros", "all 1", "[0.1, -0.2, ...]"
    call: str  # "to_empty(recurse=False)"
    library: str  # "megatron_fsdp/param_and_grad_buffer.py:2902", or "" when the user's code called it
    user: str  # "train.py:57", or ""
    noted: bool = False

    def sentence(self, path: str) -> str:
        at = f" at {self.library}" if self.library else (f" at {self.user}" if self.user else "")
        called = f", called from {self.user}" if self.library and self.user else ""
        return (f"`{path}` was real ({self.before}) before `{self.call}`{at}{called}, "
                "and was replaced by memory nobody wrote")


class Materialisations:
    """The watch over every ``to_empty`` of one capture: ``install()`` wraps it, the returned undo gives it back."""

    def __init__(self, errors: Callable[[BaseException, Any], None]) -> None:
        self.errors = errors
        self.seen: dict[int, weakref.ref] = {}  # id(module) -> module, in the order to_empty met them
        self.clobbered: list[Clobber] = []

    def install(self) -> Callable[[], None]:
        from torch import nn

        original = nn.Module.to_empty
        if getattr(original, _MARK, False):
            return lambda: None
        watch = self

        @functools.wraps(original)
        def to_empty(module: Any, *args: Any, **kwargs: Any) -> Any:
            before = watch._guard(watch._before, module, kwargs.get("recurse", True))
            result = original(module, *args, **kwargs)
            if before is not None:
                watch._guard(watch._after, module, kwargs.get("recurse", True), before, sys._getframe(1))
            return result

        setattr(to_empty, _MARK, True)
        return patch.replace(nn.Module, "to_empty", to_empty, original)

    def _guard(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # the boundary inside the job's to_empty: said in the shard, never raised
            self.errors(exc, "to_empty watch")
            return None

    def _before(self, module: Any, recurse: bool) -> dict[str, tuple[int, str]]:
        """The module's real tensors (not meta) by local name: (their storage's address, how they read). Nothing is
        held: to_empty makes each new tensor while the old one is still the module's, so a replaced tensor has a
        new address."""
        if id(module) not in self.seen:
            self.seen[id(module)] = weakref.ref(module)
        return {name: (_storage(t), describe(t)) for name, t in _named(module, recurse) if not t.is_meta and t.numel()}

    def _after(self, module: Any, recurse: bool, before: dict[str, Any], frame: Any) -> None:
        if not before:
            return
        now = dict(_named(module, recurse))
        replaced = [(n, how) for n, (at, how) in before.items()
                    if n in now and not now[n].is_meta and _storage(now[n]) != at]
        if not replaced:
            return
        library, user = lines(frame)
        call = "to_empty(recurse=False)" if not recurse else "to_empty()"
        for name, how in replaced:
            self.clobbered.append(Clobber(weakref.ref(module), name, how, call, library, user))

    def notes(self, root: Any) -> list[str]:
        """The sentences, by path from ``root``, of the clobbered tensors under it not yet said."""
        todo = [c for c in self.clobbered if not c.noted and c.module() is not None]
        if not todo or root is None or not hasattr(root, "named_modules"):
            return []
        paths = {id(m): p for p, m in root.named_modules(remove_duplicate=False)}
        out = []
        for c in todo:
            prefix = paths.get(id(c.module()))
            if prefix is not None:
                c.noted = True
                out.append(NOTE + c.sentence(f"{prefix}.{c.name}" if prefix else c.name))
        return out

    def roots(self) -> list[Any]:
        """The modules ``to_empty`` met that no other one it met holds: the models materialised, oldest first."""
        alive = [m for m in (r() for r in self.seen.values()) if m is not None]
        inner: set[int] = set()
        for m in alive:
            if id(m) not in inner:
                inner.update(id(s) for s in m.modules() if s is not m)
        return [m for m in alive if id(m) not in inner]


def _named(module: Any, recurse: bool) -> list[tuple[str, Any]]:
    return [*module.named_parameters(recurse=recurse, remove_duplicate=False),
            *module.named_buffers(recurse=recurse, remove_duplicate=False)]


def _storage(t: Any) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.untyped_storage().data_ptr()


def describe(t: Any) -> str:
    """How a tensor read: ``zeros``, ``all 1``, or its first values (a read of a real tensor, at init only; one of
    more than ``_READ`` elements is only counted)."""
    import torch

    t = t.to_local() if hasattr(t, "to_local") else t
    if t.numel() > _READ:
        return f"{t.numel()} values"
    flat = t.detach().reshape(-1)
    with torch.no_grad():
        if not flat.is_floating_point() and not flat.is_complex():
            head = flat[:4].tolist()
        else:
            if not bool(flat.any()):
                return "zeros"
            head = flat[:4].float().tolist()
        if flat.numel() > 1 and bool((flat == flat[0]).all()):
            return f"all {_num(head[0])}"
    return "[" + ", ".join(_num(v) for v in head) + (", ...]" if flat.numel() > 4 else "]")


def _num(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def lines(frame: Any) -> tuple[str, str]:
    """(the library's line, the user's line) from the frame that called ``to_empty`` outwards: the library's is
    the innermost frame of an installed package or torch (empty when the user's code called it), the user's the
    first frame of neither (nor the workbench's)."""
    from workbench.rank.ledger import is_library

    library = ""
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_WORKBENCH):
            if not is_library(fn):
                return library, f"{os.path.basename(fn)}:{f.f_lineno}"
            if not library and not fn.startswith("<"):
                library = f"{_short(fn)}:{f.f_lineno}"
        f = f.f_back
    return library, ""


def _short(fn: str) -> str:
    """A library file from its package: ``megatron_fsdp/param_and_grad_buffer.py``."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in fn:
            return fn.rsplit(marker, 1)[1]
    return os.path.join(os.path.basename(os.path.dirname(fn)), os.path.basename(fn))
