"""The sender's packing: buckets by bytes, one contiguous buffer per (bucket, dtype), with metadata.

SkyRL's CUDA-IPC sender copies every tensor of a chunk into ``packed = torch.empty(total,
dtype)`` at its offset and describes the buffer by four equal-length lists: ``names``,
``dtype_names``, ``shapes`` and ``sizes`` (elements). A receiver that has the buffer and
those lists can cut it back into named tensors; with another buffer's lists it cuts
the right bytes under the wrong names whenever the sizes happen to agree.

Casting happens here too: a sync sends every tensor in the inference dtype unless its name
ends with one of ``keep_suffixes`` (routing-critical tensors such as the router's
``e_score_correction_bias``), which keep their native dtype. Such a bucket then holds two
dtypes, and one typed buffer cannot hold both: ``pack_bucket`` packs it per dtype (first
seen first), one buffer and one metadata list each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workbench.errors import WorkbenchError
from workbench.lab.weightsync.defaults import DEFAULT_BUCKET_BYTES

ROUTING_SUFFIXES = ("e_score_correction_bias",)  # PR #1816's _FP32_SYNC_SUFFIXES

Named = tuple[str, torch.Tensor]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def dtype_of(name: str) -> torch.dtype:
    """``'bfloat16'`` or ``'torch.bfloat16'`` -> the dtype (one clear line otherwise)."""
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise WorkbenchError(f"unknown dtype name {name!r} in the weight metadata")
    return dt


@dataclass
class Packed:
    """One contiguous buffer and the lists that say how to cut it."""

    data: torch.Tensor  # 1-D, one dtype
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sizes: list[int]  # elements

    def metadata(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtype_names": list(self.dtype_names),
                "shapes": [list(s) for s in self.shapes], "sizes": list(self.sizes)}

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def sync_dtype_for(name: str, default: torch.dtype, native: torch.dtype,
                   keep_suffixes: Sequence[str] = ()) -> torch.dtype:
    """The dtype ``name`` travels in: native for a routing-critical suffix, else ``default``."""
    return native if keep_suffixes and name.endswith(tuple(keep_suffixes)) else default


def buckets(named: Iterable[Named], threshold_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[Named]]:
    """Consecutive tensors grouped until a bucket holds ``threshold_bytes`` (sized in native dtype)."""
    bucket: list[Named] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > threshold_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def pack(named: Sequence[Named]) -> Packed:
    """One buffer for tensors of one dtype: ``packed[off:off+n].copy_(t.reshape(-1))``."""
    if not named:
        raise WorkbenchError("nothing to pack: the bucket is empty")
    dtype = named[0][1].dtype
    for name, t in named:
        if t.dtype != dtype:
            raise WorkbenchError(f"tensor {name!r} is {dtype_name(t.dtype)} but the buffer is {dtype_name(dtype)}: "
                                 "pack a mixed bucket per dtype (pack_bucket)")
    sizes = [t.numel() for _, t in named]
    data = torch.empty(sum(sizes), dtype=dtype, device=named[0][1].device)
    off = 0
    for (_, t), n in zip(named, sizes):
        data[off:off + n].copy_(t.reshape(-1))
        off += n
    return Packed(data, [n for n, _ in named], [dtype_name(dtype)] * len(named),
                  [list(t.shape) for _, t in named], sizes)


def cast_for_sync(named: Iterable[Named], dtype: torch.dtype, keep_suffixes: Sequence[str] = ()) -> Iterator[Named]:
    for name, t in named:
        yield name, t.to(sync_dtype_for(name, dtype, t.dtype, keep_suffixes))


def pack_bucket(named: Sequence[Named]) -> list[Packed]:
    """A bucket of possibly mixed dtypes: one buffer per dtype, dtypes in first-seen order."""
    groups: dict[torch.dtype, list[Named]] = {}
    for name, t in named:
        groups.setdefault(t.dtype, []).append((name, t))
    return [pack(g) for g in groups.values()]


def pack_for_sync(named: Iterable[Named], dtype: torch.dtype, keep_suffixes: Sequence[str] = (),
                  threshold_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Packed]:
    """The whole sender side: bucket, cast (keeping ``keep_suffixes`` native), pack per dtype."""
    out: list[Packed] = []
    for bucket in buckets(named, threshold_bytes):
        out += pack_bucket(list(cast_for_sync(bucket, dtype, keep_suffixes)))
    return out


def check_metadata(meta: dict[str, Any], numel: int) -> None:
    """The lists agree in length, every size matches its shape, and the sizes fill ``numel``."""
    names, dts, shapes, sizes = (list(meta.get(k, ())) for k in ("names", "dtype_names", "shapes", "sizes"))
    if not (len(names) == len(dts) == len(shapes) == len(sizes)):
        raise WorkbenchError(f"weight metadata lists {len(names)} names, {len(dts)} dtypes, {len(shapes)} shapes, "
                             f"{len(sizes)} sizes")
    for name, shape, size in zip(names, shapes, sizes):
        if math.prod(shape) != size:
            raise WorkbenchError(f"tensor {name!r}: metadata size {size} but shape {list(shape)} holds "
                                 f"{math.prod(shape)} elements")
    total = sum(sizes)
    if total != numel:
        last = names[-1] if names else "<none>"
        raise WorkbenchError(f"metadata sizes add up to {total} elements but the buffer holds {numel} "
                             f"(metadata ends with tensor {last!r})")
