"""Deterministic 'uninitialised' memory, and the tracking of what was never written.

Fresh pages are often zero and reused ones hold yesterday's tensors, so a repro that
depends on ``to_empty`` garbage comes and goes. While poisoning is on, every tensor that
``nn.Module.to_empty`` hands out is filled with a signalling-NaN bit pattern (floats) or
the dtype's max (integers). The pattern is chosen so that arithmetic never produces it:
an element that still holds it was never written since it was materialised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

# Signalling NaNs with a payload (0xA5...): computation quiets a NaN, so these bits only
# survive in memory nobody wrote.
POISON_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.bfloat16: (torch.int16, 0x7FA5),
    torch.float16: (torch.int16, 0x7D5A),
    torch.float64: (torch.int64, 0x7FF4A5A5A5A5A5A5),
}

_ORIGINAL_TO_EMPTY = nn.Module.to_empty
_STATE = {"poison": False, "materialized": 0}


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


def _poisoning_to_empty(self: nn.Module, *, device, recurse: bool = True) -> nn.Module:
    out = _ORIGINAL_TO_EMPTY(self, device=device, recurse=recurse)
    if _STATE["poison"]:
        with torch.no_grad():
            for t in _tensors(self, recurse):
                poison_(t.data)
                _STATE["materialized"] += 1
    return out


def set_poison(on: bool) -> None:
    """Turn poisoning of ``to_empty`` on or off for this process."""
    _STATE["poison"] = bool(on)
    nn.Module.to_empty = _poisoning_to_empty if on else _ORIGINAL_TO_EMPTY


@contextlib.contextmanager
def poisoned(on: bool = True) -> Iterator[None]:
    before = _STATE["poison"]
    set_poison(on)
    try:
        yield
    finally:
        set_poison(before)
