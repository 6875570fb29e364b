"""A position-sensitive content fingerprint of a tensor's bytes, on its own device.

Its own module because both the probe (a column per tensor) and the poison tracker
(was this tensor written since materialisation?) need it, and neither should import
the other for it. ``_probe_triton`` must stay bit-identical to ``_fingerprint_lanes``.
"""

from __future__ import annotations

import numpy as np
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


def lanes_u32(words: np.ndarray, starts: np.ndarray, positions: tuple[np.ndarray, np.ndarray],
              scratch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """``_fingerprint_lanes`` of many tensors at once, on the host: ``words`` (uint32) are their words laid end
    to end, tensor i's from ``starts[i]``; ``positions`` is ``position_terms`` of the same layout; ``scratch``,
    three uint32 arrays at least as long as ``words``, takes the temporaries. Returns [T, 2] lanes.

    The same function as the torch one, in uint32 arithmetic: numpy's uint32 wraps modulo 2**32 by itself,
    so the masks the int64 version needs after each product are gone, and every pass moves half the bytes
    (the CPU probe's cost is this arithmetic's memory traffic). A lane's terms are summed per tensor in
    uint64; the low 32 bits of a sum do not depend on its order."""
    n = len(words)
    a, c, t = (np.empty(n, np.uint32) for _ in range(3)) if scratch is None else (b[:n] for b in scratch)
    pk1, pk3 = positions
    np.bitwise_xor(words, pk1, out=a)
    np.multiply(a, np.uint32(_K2), out=a)
    np.bitwise_xor(a, np.right_shift(a, np.uint32(15), out=t), out=a)
    np.add(words, pk3, out=c)
    np.multiply(c, np.uint32(_K4), out=c)
    np.bitwise_xor(c, np.right_shift(c, np.uint32(13), out=t), out=c)
    return np.stack([np.add.reduceat(a, starts, dtype=np.uint64), np.add.reduceat(c, starts, dtype=np.uint64)],
                    axis=1) & np.uint64(_M32)


def position_terms(counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(idx * K1, idx * K3) mod 2**32 for word positions idx restarting at 1 in each of tensors of ``counts``
    words: what ``lanes_u32`` needs besides the words. Fixed for a layout, and a model's layouts (the probe's
    batches, the trace's output shapes) recur step after step: the most recent are kept, up to
    ``_KEPT_BYTES`` (read-only arrays, 8 bytes a word)."""
    terms = _TERMS.pop(counts, None)
    if terms is None:
        idx = np.arange(1, sum(counts) + 1, dtype=np.uint32)
        if len(counts) > 1:
            idx -= np.repeat(np.cumsum((0, *counts[:-1]), dtype=np.uint32), counts)
        terms = idx * np.uint32(_K1), idx * np.uint32(_K3)
        for t in terms:
            t.flags.writeable = False
    _TERMS[counts] = terms  # most recent last
    while sum(8 * len(k1) for k1, _ in _TERMS.values()) > _KEPT_BYTES and len(_TERMS) > 1:
        del _TERMS[next(iter(_TERMS))]
    return terms


_TERMS: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
_KEPT_BYTES = 16 << 20
_ORIGIN = np.zeros(1, dtype=np.int64)


def fingerprint_host(words: np.ndarray) -> int:
    """``_fingerprint`` of one tensor whose bytes are ``words`` (uint32, on the host), as an unsigned 64-bit int."""
    (h1, h2), = lanes_u32(words, _ORIGIN, position_terms((len(words),))).tolist()
    return (h1 << 32) | h2
