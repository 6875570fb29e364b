"""The probe's CPU pass: many small tensors summarised by a few operations over all of them.

On CPU a probe's cost is op dispatch, not bytes: the plain path runs about twenty small torch
ops a tensor, 6 ms for the headline model's 27 tensors, most of a step's overhead on two
ranks. Here the tensors of one dtype are laid end to end once, every statistic is one pass
over that batch, and numpy's ``reduceat`` splits it per tensor.

The values are the plain path's, bit for bit (``tests/test_probe.py`` compares): min, max
and the counts are exact in any order and the fingerprint's lanes are wrapping integer sums,
so a split sum equals the whole one; the mean is a float sum, whose rounding depends on its
order, so it stays each tensor's own ``sum()``, the one per-tensor op left. A tensor holding
a NaN or an infinity goes back to the plain path, which counts them and the poison (rare:
most of a model is finite).

Every read of a tensor's memory by numpy goes through ``host``, never ``Tensor.numpy()``: that call marks the
tensor's storage not resizable for good (torch's guard for the array it hands out), and FSDP2 frees an unsharded
parameter by resizing its storage to 0 after backward: a probe at the ``forward`` point took the job down
("Trying to resize storage that is not resizable").
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import numpy as np
import torch

from workbench.rank.columns import WINDOW, WINDOW_OFFSETS
from workbench.rank.fingerprint import lanes_u32, position_terms
from workbench.rank.probe_fused import HEAD, n_windows, raw_len

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BATCH_BYTES = 1 << 20  # a batch is one copy of its tensors, into buffers kept at about 7x this

Member = tuple[dict[str, Any], torch.Tensor]  # a row to fill, its tensor flattened


def batchable(flat: torch.Tensor) -> bool:
    """A plain (no subclass: a DTensor's memory is its local shard's, read by the plain path), contiguous CPU float
    tensor of whole 32-bit words (the fingerprint's words then never straddle two
    tensors of a batch), at a word-aligned address (one alone is read in place), up to a batch in size (a
    larger one costs its bytes, not its dispatch: the plain path reads it as fast)."""
    es = flat.element_size()
    nbytes = flat.numel() * es
    return (type(flat) is torch.Tensor and flat.device.type == "cpu" and flat.dtype in DTYPES and flat.is_contiguous()
            and nbytes % 4 == 0 and nbytes <= BATCH_BYTES and (flat.storage_offset() * es) % 4 == 0)


def fill(members: list[Member]) -> list[Member]:
    """Fill the statistic columns of every member's row; return the members left to the plain path."""
    groups: dict[torch.dtype, list[Member]] = {}
    for member in members:
        groups.setdefault(member[1].dtype, []).append(member)
    left: list[Member] = []
    for group in groups.values():
        for batch in _batches(group):
            left += _fill_batch(batch)
    return left


def _batches(group: list[Member]) -> list[list[Member]]:
    out: list[list[Member]] = []
    size = BATCH_BYTES
    for member in group:
        nbytes = member[1].numel() * member[1].element_size()
        if size + nbytes > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(member)
        size += nbytes
    return out


def _fill_batch(batch: list[Member]) -> list[Member]:
    flats = [flat for _, flat in batch]
    dtype = flats[0].dtype
    numels = [f.numel() for f in flats]
    n = sum(numels)
    with torch.no_grad():
        whole = flats[0] if len(flats) == 1 else torch.cat(
            flats, out=_scratch("whole", torch.uint8, n * flats[0].element_size()).view(dtype))
        # read as the plain path reads: bf16 and fp16 widened to fp32
        x = whole if dtype in (torch.float32, torch.float64) else _scratch("x", torch.float32, n).copy_(whole)
        xs = torch.split(x, numels)
        means = (torch.stack([part.sum() / k for part, k in zip(xs, numels)]).to(torch.float64).tolist())
    xn = host(x)
    starts = np.fromiter(accumulate(numels[:-1], initial=0), dtype=np.int64, count=len(numels))
    finite = np.isfinite(xn, out=host(_scratch("finite", torch.bool, n)))
    ok = (np.ones(len(batch), dtype=bool) if finite.all()
          else np.add.reduceat(finite, starts, dtype=np.int64) == np.asarray(numels))
    with np.errstate(invalid="ignore"):  # a signalling NaN (poison) widened is no error here
        lo = np.minimum.reduceat(xn, starts).astype(np.float64).tolist()
        hi = np.maximum.reduceat(xn, starts).astype(np.float64).tolist()
        heads = xn[np.minimum(starts[:, None] + np.arange(HEAD), n - 1)].astype(np.float64).tolist()
    with np.errstate(invalid="ignore", over="ignore"):  # a batch with a NaN goes to the plain path anyway
        sq = np.square(xn, dtype=np.float64)  # exact (a float32 squared fits a float64); summed per tensor below
    fps = _fingerprints(whole, numels)
    raw = host(whole, np.uint8)
    left: list[Member] = []
    base = 0
    for i, (row, flat) in enumerate(batch):
        nbytes = numels[i] * flat.element_size()
        if not ok[i]:
            left.append((row, flat))
        else:
            row.update(nan=0, inf=0, poisoned=0, min=lo[i], max=hi[i], mean=means[i], head=heads[i][:numels[i]],
                       fingerprint=fps[i], raw=raw[base: base + raw_len(nbytes)].tobytes().hex(),
                       windows=b"".join(raw[base + off: base + off + WINDOW].tobytes()
                                        for off in WINDOW_OFFSETS[: n_windows(nbytes)]).hex(),
                       sumsq=float(np.add.reduce(sq[starts[i]: starts[i] + numels[i]])))
        base += nbytes
    return left


def sumsq(x: torch.Tensor) -> float:
    """The sum of squares of ``x``'s finite values, summed as the batched pass sums them (bit for bit: numpy's
    pairwise sum over one tensor's float64 squares), for the plain path's CPU tensors."""
    with np.errstate(invalid="ignore", over="ignore"):  # a signalling NaN (poison) widened is no error here
        v = np.square(host(x), dtype=np.float64)
    if not np.isfinite(v).all():
        v[~np.isfinite(v)] = 0.0
    return float(np.add.reduce(v))


def _fingerprints(whole: torch.Tensor, numels: list[int]) -> list[str]:
    """Every tensor's fingerprint: the batch's words mixed in one pass, positions restarting at each tensor."""
    es = whole.element_size()
    counts = tuple(n * es // 4 for n in numels)
    positions = position_terms(counts)
    starts = np.fromiter(accumulate(counts[:-1], initial=0), dtype=np.int64, count=len(counts))
    w = sum(counts)
    scratch = tuple(host(_scratch(name, torch.int32, w), np.uint32) for name in ("a", "c", "t"))
    lanes = lanes_u32(host(whole, np.uint32), starts, positions, scratch).tolist()
    return [f"{p:08x}{q:08x}" for p, q in lanes]


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.bool: np.bool_,
          torch.uint8: np.uint8, torch.int32: np.int32, torch.int64: np.int64}


class _Held:
    """A contiguous CPU tensor's bytes as numpy's array interface: the array keeps this (and so the tensor) alive,
    and torch's storage is never told an array exists."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.__array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                    "data": (t.data_ptr(), False), "version": 3}


def host(t: torch.Tensor, dtype: Any = None) -> np.ndarray:
    """``t`` (on CPU) flattened, as a numpy array over its own memory, no copy, as ``t.numpy()`` gives it
    (``dtype``: its bytes read as another numpy dtype, ``t.view(...).numpy()``) but leaving its storage
    resizable: ``Tensor.numpy()`` marks a storage not resizable for ever, and FSDP2 (or any owner of that
    memory) resizes it later."""
    if type(t) is not torch.Tensor:  # a subclass has no memory of its own (data_ptr 0): read a plain tensor
        t = _plain(t)
    dtype = np.dtype(dtype if dtype is not None else _NUMPY[t.dtype])
    if t.device.type != "cpu":
        raise TypeError(f"host() reads a CPU tensor, not one on {t.device}")
    if not t.numel():
        return np.empty(0, dtype=dtype)
    return np.asarray(_Held(t.contiguous())).view(dtype)  # strided: read from a copy


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass as a plain tensor of the same values: a DTensor its local shard, anything else (a TP
    output still an ``AsyncCollectiveTensor``) a copy, which its dispatch hands back plain (waiting first)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if type(t) is not torch.Tensor:
        with torch.no_grad():
            t = t.clone()
    if type(t) is not torch.Tensor:
        raise TypeError(f"host() cannot read a {type(t).__name__}")
    return t.reshape(-1)


def _scratch(name: str, dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` elements of a buffer this process keeps for the batches: fresh memory for every probe costs a page
    fault a page (on an engine after FSDP's allocations, 2.5 ms of a 4 ms probe; glibc hands large blocks
    back to the kernel on free). Sized for the largest batch: ``x`` holds a batch of 2-byte floats widened."""
    cap = BATCH_BYTES // torch.empty((), dtype=dtype).element_size() * (2 if name == "x" else 1)
    buf = _SCRATCH.get(name)
    if buf is None:
        buf = _SCRATCH[name] = torch.empty(cap, dtype=dtype)
    return buf[:n]


_SCRATCH: dict[str, torch.Tensor] = {}
