"""A position-sensitive content fingerprint of a tensor's bytes, on its own device.

Its own module because both the probe (a column per tensor) and the poison tracker
(was this tensor written since materialisation?) need it, and neither should import
the other for it. ``_probe_triton`` must stay bit-identical to ``_fingerprint_lanes``.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Odd 32-bit multipliers (golden ratio, murmur3 and xxhash primes).
_K1, _K2, _K3, _K4 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F


def _words(flat: torch.Tensor) -> torch.Tensor:
    """The bytes of ``flat`` as little-endian uint32 words in int64, zero-padded."""
    b = flat.contiguous().view(torch.uint8) if flat.element_size() != 1 or flat.dtype != torch.uint8 else flat
    b = b.reshape(-1)
    pad = (-b.numel()) % 4
    if pad or b.storage_offset() % 4:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    return b.view(torch.int32).to(torch.int64) & _M32


def _fingerprint_lanes(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = _words(flat)
    idx = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64)
    # In place where it can be: the same values as the expressions in the comments, with two
    # temporaries instead of twelve (on CPU the probe's time is this arithmetic's memory traffic).
    a = idx * _K1  # a = ((w ^ ((idx * K1) & M32)) * K2) & M32; a ^= a >> 15
    a.bitwise_and_(_M32).bitwise_xor_(w).mul_(_K2).bitwise_and_(_M32)
    a.bitwise_xor_(a >> 15)
    c = idx.mul_(_K3)  # c = (((w + idx * K3) & M32) * K4) & M32; c ^= c >> 13
    c.add_(w).bitwise_and_(_M32).mul_(_K4).bitwise_and_(_M32)
    c.bitwise_xor_(c >> 13)
    return a.sum() & _M32, c.sum() & _M32


def _fingerprint(flat: torch.Tensor) -> torch.Tensor:
    """Position-sensitive hash of the bytes as a 0-d int64: lane 1 in the high word."""
    h1, h2 = _fingerprint_lanes(flat)
    return (h1 << 32) | h2
