"""Per-rank tensor summaries: small rows out, never tensors.

All reductions run on the tensor's own device and land in one flat float64 buffer that
crosses to the host once, so a probe costs one sync whatever the number of tensors.
The row vocabulary (column names) is shared by frames, the CLI's JSON and bundles.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from workbench.rank.poison import poison_count

HEAD = 8
RAW_SMALL = 256  # bytes kept whole for tensors up to this size
RAW_LARGE = 64  # bytes kept from the start of larger tensors
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constants (golden ratio, splitmix64), signed
_MIX2 = 0xBF58476D1CE4E5B9 - (1 << 64)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

COLUMNS = [
    "rank", "name", "kind", "dtype", "device", "is_meta", "shape", "numel",
    "nan", "inf", "poisoned", "min", "max", "mean", "head", "fingerprint", "raw",
]


def named_tensors(module: nn.Module, prefix: str = "") -> list[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) for every parameter and buffer, kind telling persistence apart."""
    out: list[tuple[str, str, torch.Tensor]] = []
    for name, p in module.named_parameters():
        out.append((prefix + name, "parameter", p))
    for mod_name, mod in module.named_modules():
        for local, b in mod.named_buffers(recurse=False):
            if b is None:
                continue
            kind = "non-persistent buffer" if local in mod._non_persistent_buffers_set else "buffer"
            full = f"{mod_name}.{local}" if mod_name else local
            out.append((prefix + full, kind, b))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return (to_local() if callable(to_local) else t).detach()


def _fingerprint(flat: torch.Tensor) -> torch.Tensor:
    """Position-sensitive hash of the bytes (xor-shift-multiply per element, then a sum)."""
    view = _INT_VIEW[flat.element_size()]
    bits = flat.view(view).to(torch.int64)
    if view is torch.uint8:
        bits = bits & 0xFF
    h = bits ^ (torch.arange(1, bits.numel() + 1, device=flat.device, dtype=torch.int64) * _MIX)
    h = (h ^ (h >> 31)) * _MIX2
    h = h ^ (h >> 29)
    return h.sum() ^ bits.numel()


def _stats(flat: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[nan, inf, poisoned, min, max, mean] over finite values, and the head, on device."""
    x = flat if flat.dtype == torch.float64 else flat.float()
    if flat.is_floating_point():
        nan, inf = torch.isnan(x).sum(), torch.isinf(x).sum()
        finite = torch.isfinite(x)
        nfin = finite.sum()
        lo = torch.where(finite, x, math.inf).min()
        hi = torch.where(finite, x, -math.inf).max()
        mean = torch.where(finite, x, 0.0).sum() / nfin.clamp(min=1)
        some = nfin > 0
        lo, hi, mean = (torch.where(some, v, math.nan) for v in (lo, hi, mean))
    else:
        zero = torch.zeros((), device=flat.device, dtype=torch.int64)
        nan, inf, lo, hi, mean = zero, zero, x.min(), x.max(), x.mean()
    pc = poison_count(flat)
    if pc is None:
        pc = torch.zeros((), device=flat.device, dtype=torch.int64)
    return [nan, inf, pc, lo, hi, mean], x[:HEAD]


def probe_tensors(items: Iterable[tuple[str, str, torch.Tensor]], rank: int) -> list[dict[str, Any]]:
    """Summaries of (name, kind, tensor) triples; one host sync for all of them."""
    rows: list[dict[str, Any]] = []
    parts: list[torch.Tensor] = []
    layout: list[tuple[int, int, int]] = []  # per row: head length, raw length, fp words
    for name, kind, t in items:
        t = _local(t)
        row = {
            "rank": rank, "name": name, "kind": kind, "dtype": str(t.dtype).replace("torch.", ""),
            "device": str(t.device), "is_meta": bool(t.is_meta), "shape": "x".join(map(str, t.shape)) or "()",
            "numel": int(t.numel()),
        }
        rows.append(row)
        if t.is_meta or t.numel() == 0 or t.is_complex():
            layout.append((-1, 0, 0))
            continue
        flat = t.reshape(-1)
        with torch.no_grad():
            stats, head = _stats(flat)
            nbytes = flat.numel() * flat.element_size()
            raw_n = nbytes if nbytes <= RAW_SMALL else RAW_LARGE
            raw = flat.view(torch.uint8)[:raw_n] if flat.element_size() == 1 else (
                flat[: (raw_n + flat.element_size() - 1) // flat.element_size()].view(torch.uint8)[:raw_n]
            )
            fp = _fingerprint(flat)
            fp_words = torch.stack([(fp >> 32) & 0xFFFFFFFF, fp & 0xFFFFFFFF])
        dev = flat.device
        parts += [torch.stack([s.to(dev, torch.float64) for s in stats]), head.to(torch.float64),
                  raw.to(torch.float64), fp_words.to(torch.float64)]
        layout.append((head.numel(), raw_n, 2))
    host = _to_host(parts)
    pos = 0
    for row, (n_head, n_raw, _) in zip(rows, layout):
        if n_head < 0:
            row.update(nan=None, inf=None, poisoned=None, min=None, max=None, mean=None,
                       head=[], fingerprint="meta" if row["is_meta"] else "empty", raw="")
            continue
        s = host[pos: pos + 6]
        pos += 6
        head = host[pos: pos + n_head]
        pos += n_head
        raw = bytes(int(b) for b in host[pos: pos + n_raw])
        pos += n_raw
        hi, lo = int(host[pos]), int(host[pos + 1])
        pos += 2
        row.update(
            nan=int(s[0]), inf=int(s[1]), poisoned=int(s[2]),
            min=float(s[3]), max=float(s[4]), mean=float(s[5]),
            head=[float(v) for v in head], fingerprint=f"{hi:08x}{lo:08x}", raw=raw.hex(),
        )
    return rows


def _to_host(parts: list[torch.Tensor]) -> list[float]:
    if not parts:
        return []
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in parts:
        by_device.setdefault(p.device, []).append(p)
    if len(by_device) == 1:
        return torch.cat(parts).cpu().tolist()
    return torch.cat([p.cpu() for p in parts]).tolist()


def probe_module(module: nn.Module, rank: int, prefix: str = "") -> list[dict[str, Any]]:
    return probe_tensors(named_tensors(module, prefix), rank)


def probe_dict(tensors: Mapping[str, torch.Tensor], rank: int, prefix: str = "",
               kind: str = "tensor") -> list[dict[str, Any]]:
    return probe_tensors(((prefix + k, kind, v) for k, v in tensors.items() if isinstance(v, torch.Tensor)), rank)


def probe_objects(objects: Mapping[str, Any], rank: int) -> list[dict[str, Any]]:
    """Probe every nn.Module and dict of tensors among ``objects``, names prefixed by key."""
    rows: list[dict[str, Any]] = []
    for key, obj in objects.items():
        if isinstance(obj, nn.Module):
            rows += probe_module(obj, rank, prefix=f"{key}.")
        elif isinstance(obj, Mapping) and any(isinstance(v, torch.Tensor) for v in obj.values()):
            rows += probe_dict(obj, rank, prefix=f"{key}.")
        elif isinstance(obj, torch.Tensor):
            rows += probe_tensors([(key, "tensor", obj)], rank)
    return rows
