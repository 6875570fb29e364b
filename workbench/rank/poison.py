"""Deterministic 'uninitialised' memory, and the tracking of what was never written.

Fresh pages are often zero and reused ones hold yesterday's tensors, so a repro that
depends on ``to_empty`` garbage comes and goes. While poisoning is on, every tensor that
``nn.Module.to_empty`` hands out is filled with a signalling-NaN bit pattern (floats) or
the dtype's max (integers). The pattern is chosen so that arithmetic never produces it:
an element that still holds it was never written since it was materialised.

While a step runs (``allocations()``), the Python-level allocators that hand out
uninitialised memory are covered too: ``torch.empty``, ``empty_like``, ``empty_strided``,
``Tensor.new_empty``/``new_empty_strided`` and the growth of ``Tensor.resize_``; so is a
user's own materialisation path such as ``module._apply(lambda t: torch.empty_like(t,
device=...))``. Allocations made inside C++ kernels are not seen (they are outputs the
kernel writes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# At import, not at first use: ``track`` runs inside a stack's own materialisation (Megatron-FSDP's per-module
# ``to_empty``, DeepSpeed's ``zero.Init`` with its patched tensor constructors), where a first import is a risk
# the job did not take (docs/stacks.md).
from workbench.rank.fingerprint import _fingerprint

# Signalling NaNs with a payload (0xA5...): computation quiets a NaN, so these bits only
# survive in memory nobody wrote.
POISON_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.bfloat16: (torch.int16, 0x7FA5),
    torch.float16: (torch.int16, 0x7D5A),
    torch.float64: (torch.int64, 0x7FF4A5A5A5A5A5A5),
}

_ORIGINAL_TO_EMPTY = nn.Module.to_empty
_STATE: dict[str, Any] = {"poison": False, "materialized": 0,
                          # a guest in someone's job (``workbench.job``): ``guest(exc)`` hears of the hooks' own
                          # failures instead of the job (the call the job made still returns its tensor); None
                          # (live sessions): they raise, as before
                          "guest": None}
# data_ptr -> (poisoned at materialisation?, fingerprint then, numel): the tensors to_empty handed out.
_TRACKED: dict[int, tuple[bool, int | None, int]] = {}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with the poison pattern of its dtype."""
    if t.is_meta or t.numel() == 0:
        return t
    if t.dtype in POISON_BITS:
        int_dtype, bits = POISON_BITS[t.dtype]
        t.view(int_dtype).fill_(bits)
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif not t.is_complex():
        t.fill_(torch.iinfo(t.dtype).max)
    return t


def poison_count(t: torch.Tensor) -> torch.Tensor | None:
    """Number of elements still holding the poison bits, as a 0-d device tensor."""
    if t.dtype not in POISON_BITS:
        return None
    int_dtype, bits = POISON_BITS[t.dtype]
    return (t.reshape(-1).view(int_dtype) == bits).sum()


def _tensors(module: nn.Module, recurse: bool) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


def _tracking_to_empty(self: nn.Module, *, device, recurse: bool = True) -> nn.Module:
    out = _ORIGINAL_TO_EMPTY(self, device=device, recurse=recurse)
    try:
        with torch.no_grad():
            for t in _tensors(self, recurse):
                track(t.data, poison=_STATE["poison"])
    except Exception as exc:  # a boundary: the job's to_empty returns its module; _failed says the fault
        _failed(exc)
    return out


def _failed(exc: BaseException) -> None:
    """A hook's own error: the guest's (its capture turns poison off), else raised."""
    guest = _STATE.get("guest")
    if guest is None:
        raise exc
    _STATE["guest"] = None
    nn.Module.to_empty = _ORIGINAL_TO_EMPTY
    _STATE["poison"] = False
    guest(exc)


def track(t: torch.Tensor, poison: bool) -> None:
    """Remember ``t`` as freshly materialised (and poison it when asked)."""
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2): its local shard, as the probe keys it
    if t.is_meta or t.numel() == 0:
        return
    if poison:
        poison_(t)
        _TRACKED[t.data_ptr()] = (True, None, t.numel())
    else:
        _TRACKED[t.data_ptr()] = (False, int(_fingerprint(t.reshape(-1))), t.numel())
    _STATE["materialized"] += 1


_U64 = (1 << 64) - 1


def written_state(t: torch.Tensor, poisoned: int | None = None, fingerprint: str | None = None) -> str | None:
    """'never written' / 'partly written' / 'written' for tensors to_empty handed out, else None.

    With poison on this is exact per element; without, a tensor whose bytes still hash
    to what to_empty left is 'never written'. ``poisoned`` and ``fingerprint``: the probe's
    values for ``t`` when it has them (the poison count and the hash are then not computed twice).
    """
    if t.is_meta or t.numel() == 0:
        return None
    return written_from(t.numel(), t.dtype in POISON_BITS, poisoned, fingerprint, _TRACKED.get(t.data_ptr()), t)


def written_from(numel: int, poisonable: bool, poisoned: int | None, fingerprint: str | None,
                 entry: tuple | None, t: torch.Tensor | None = None) -> str | None:
    """``written_state`` from facts read earlier: the tensor's size, whether poison can mark its dtype, the probe's
    poison count and hash, its tracking entry (``tracked``). A point finished on the writer thread reads these
    at the point, on the job's thread; ``t`` is read only where the probe gave neither count nor hash."""
    left: int | None = None
    if poisonable:
        # Poison bits are only ever written by poison_: where some remain, the answer needs no tracking entry
        # (a view into a flat buffer, an address reused since, all read the same).
        left = int(poison_count(t)) if poisoned is None else int(poisoned)
        if left:
            return "never written" if left == numel else "partly written"
    if entry is None or entry[2] != numel:
        return None
    was_poisoned, fp, _ = entry
    if was_poisoned:
        n = left or 0  # None: a dtype poison cannot mark
        return "never written" if n == numel else ("partly written" if n else "written")
    if fingerprint is not None and len(fingerprint) == 16:  # not "meta"/"empty" (a complex tensor's)
        return "never written" if int(fingerprint, 16) == fp & _U64 else "written"  # fp: a signed int64
    return "never written" if int(_fingerprint(t.reshape(-1))) == fp else "written"


def tracked(ptrs: list[int]) -> list[tuple | None]:
    """The tracking entries at these addresses now (``written_from``'s ``entry``)."""
    return list(map(_TRACKED.get, ptrs))


def reset_tracking() -> None:
    _TRACKED.clear()


def set_poison(on: bool) -> None:
    """Poison (or not) what ``to_empty`` hands out; either way, track it."""
    _STATE["poison"] = bool(on)
    current = nn.Module.to_empty
    while current is not _tracking_to_empty and getattr(current, "__wrapped__", None) is not None:
        current = current.__wrapped__  # a wrapper of the tracker (the job's automatic points) stays on top
    if current is not _tracking_to_empty:
        nn.Module.to_empty = _tracking_to_empty


@contextlib.contextmanager
def poisoned(on: bool = True) -> Iterator[None]:
    before = _STATE["poison"]
    set_poison(on)
    try:
        yield
    finally:
        set_poison(before)


def set_guest(hear: Callable[[BaseException], None] | None) -> None:
    """A guest in someone's job: ``hear(exc)`` gets the hooks' own failures instead of the job (None: they raise)."""
    _STATE["guest"] = hear


def pause() -> None:
    """Stop filling what ``to_empty`` hands out (a capture's fault); tracking goes on until the capture's undo."""
    _STATE["poison"] = False


def saved() -> Callable[[], None]:
    """The undo of a capture's poison: ``to_empty`` and the poison state as they were found (a live session's tracker
    left on, say), not the pristine original: a capture's close leaves torch as it found it."""
    to_empty, poison, guest = nn.Module.to_empty, _STATE["poison"], _STATE["guest"]

    def restore() -> None:
        _STATE["poison"], _STATE["guest"] = poison, guest
        nn.Module.to_empty = to_empty

    return restore


def uninstall() -> None:
    """Give ``nn.Module.to_empty`` back untouched (end of a session)."""
    _STATE["poison"] = False
    _STATE["guest"] = None
    nn.Module.to_empty = _ORIGINAL_TO_EMPTY


# -- every allocator of uninitialised memory, while a step runs ----------------------------
# A TorchFunctionMode, not patched names: ``torch.device("meta")`` (itself a function mode) keeps working, and
# torch's own caches of its factory functions never see a wrapper.
_ALLOCATORS = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty,
               torch.Tensor.new_empty_strided}


class _Allocations(TorchFunctionMode):
    """With poison on: poison and track what the allocators hand out, poison what ``resize_`` grows."""

    off = False  # a guest's mode after its hook failed, left below a mode the job pushed since: passes through

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        before = args[0].numel() if func is torch.Tensor.resize_ else 0
        out = func(*args, **kwargs)
        try:
            self._after(func, out, before)
        except Exception as exc:  # a boundary: the job's call returns its tensor; _failed says the fault
            self.off = _STATE.get("guest") is not None
            _failed(exc)
        return out

    @staticmethod
    def _after(func: Any, out: Any, before: int) -> None:
        """Poison what ``resize_`` grew (``before``: its numel before), track what an allocator handed out."""
        if func is torch.Tensor.resize_:
            if _STATE["poison"] and out.numel() > before and not out.is_meta and out.is_contiguous():
                with torch.no_grad():
                    poison_(out.detach().reshape(-1)[before:])  # only the grown part is uninitialised
            return
        # With poison off only to_empty is tracked (by fingerprint): hashing every allocation would itself
        # allocate and change which stale bytes the allocator hands out next, the very thing poison-off shows.
        if _STATE["poison"] and func in _ALLOCATORS and isinstance(out, torch.Tensor):
            with torch.no_grad():
                track(out.detach(), poison=True)


@contextlib.contextmanager
def allocations() -> Iterator[None]:
    """Poison and track (with poison on) every uninitialised allocation made from Python inside the block."""
    with _Allocations():
        yield
