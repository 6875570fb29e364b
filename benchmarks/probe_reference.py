"""The GPU probe as it was before the packed single-launch path (main 06518e8), frozen.

Kept only to check that today's rows are byte-identical to these: `tests/test_probe_identity.py`
on CPU (and through Triton's interpreter), `benchmarks/probe_scale.py` on a GPU. Not product code.

All reductions run on the tensor's own device and land in one flat float64 buffer that
crosses to the host once, so a probe costs one sync whatever the number of tensors.
The row vocabulary (column names) is shared by frames, the CLI's JSON and bundles.

On CUDA, with Triton present, bf16/fp16/fp32 tensors are summarised by one fused pass
per dtype (``_fused``): one kernel reads each byte once and computes every statistic and
the fingerprint, so probing a billion-parameter model costs about one read of its
memory. Everything else (CPU, other dtypes, odd sizes or alignments) takes the plain
torch path, which computes the same values (the fingerprint bit for bit).

The fingerprint hashes the tensor's bytes as little-endian 32-bit words (zero-padded to
a whole word): two 32-bit lanes, each the wrapping sum over words of a mix of the word and
its 1-based position. Equal bytes give equal fingerprints on any device; moving a word
changes it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from contextlib import nullcontext as _nullcontext
from typing import Any

import torch
from torch import nn

from workbench.rank.columns import COLUMNS, WINDOW, WINDOW_OFFSETS  # noqa: F401  (re-exported: the row vocabulary)

# The fingerprint and the poison count, frozen here as they were (not imported from the live modules): a
# reference that imports what it checks would agree with any change to them.
_M32 = 0xFFFFFFFF
POISON_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.bfloat16: (torch.int16, 0x7FA5),
    torch.float16: (torch.int16, 0x7D5A),
    torch.float64: (torch.int64, 0x7FF4A5A5A5A5A5A5),
}


def poison_count(t: torch.Tensor) -> torch.Tensor | None:
    if t.dtype not in POISON_BITS:
        return None
    int_dtype, bits = POISON_BITS[t.dtype]
    return (t.reshape(-1).view(int_dtype) == bits).sum()


def _fingerprint_lanes(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = flat.contiguous().view(torch.uint8) if flat.element_size() != 1 or flat.dtype != torch.uint8 else flat
    b = b.reshape(-1)
    pad = (-b.numel()) % 4
    if pad or b.storage_offset() % 4:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    w = b.view(torch.int32).to(torch.int64) & _M32
    idx = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64)
    a = ((w ^ ((idx * 0x9E3779B1) & _M32)) * 0x85EBCA77) & _M32
    a = a ^ (a >> 15)
    c = (((w + idx * 0xC2B2AE3D) & _M32) * 0x27D4EB2F) & _M32
    c = c ^ (c >> 13)
    return a.sum() & _M32, c.sum() & _M32

HEAD = 8
RAW_SMALL = 256  # bytes kept whole for tensors up to this size
RAW_LARGE = 64  # bytes kept from the start of larger tensors
_NO_DATA = {"nan": None, "inf": None, "poisoned": None, "min": None, "max": None, "mean": None, "head": []}


def named_tensors(module: nn.Module, prefix: str = "") -> list[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) for every parameter and buffer, kind telling persistence apart.

    Parameters first (``named_parameters`` order and names, shared ones once), then buffers.
    """
    params: list[tuple[str, str, torch.Tensor]] = []
    bufs: list[tuple[str, str, torch.Tensor]] = []
    plain = type(module).named_parameters is nn.Module.named_parameters  # wrappers (FSDP) rename theirs
    if not plain:
        params = [(prefix + name, "parameter", p) for name, p in module.named_parameters()]
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        pre = f"{prefix}{mod_name}." if mod_name else prefix
        if plain:
            for local, p in mod._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                params.append((pre + local, "parameter", p))
        if mod._buffers:
            nonpers = mod._non_persistent_buffers_set
            for local, b in mod._buffers.items():
                if b is not None:
                    bufs.append((pre + local, "non-persistent buffer" if local in nonpers else "buffer", b))
    return params + bufs


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        to_local = getattr(t, "to_local", None)
        if callable(to_local):
            t = to_local()
    return t.detach()


# -- the plain torch path (any device, any dtype) -------------------------------------
def _stats(flat: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[nan, inf, poisoned, min, max, mean] over finite values, and the head, on device."""
    x = flat if flat.dtype == torch.float64 else flat.float()
    if flat.is_floating_point() and flat.device.type == "cpu":
        fast = _all_finite_stats(x)
        if fast is not None:
            return fast, x[:HEAD]
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


def _all_finite_stats(x: torch.Tensor) -> list[torch.Tensor] | None:
    """On CPU a sync costs nothing: when every value is finite (most tensors), skip the masking
    passes. Same values as the general path (the same elements summed in the same order), and no
    poison to count: the poison pattern is a NaN."""
    n = x.numel()
    if int(torch.isfinite(x).sum()) != n:
        return None
    zero = torch.zeros((), dtype=torch.int64)
    lo, hi = torch.aminmax(x)
    return [zero, zero, zero, lo, hi, x.sum() / n]


def _raw_len(nbytes: int) -> int:
    return nbytes if nbytes <= RAW_SMALL else RAW_LARGE


def _n_windows(nbytes: int) -> int:
    return sum(1 for off in WINDOW_OFFSETS if nbytes >= off + WINDOW) if nbytes > RAW_SMALL else 0


def _windows_many(flats: list[torch.Tensor]) -> torch.Tensor:
    """The bytes at ``WINDOW_OFFSETS`` inside each of many same-dtype tensors (offsets are multiples of
    every element size), in one copy: the slices are views, one ``cat`` moves
    them (per-tensor slicing, copying and casting cost ~8 kernel launches a tensor: 13 ms at 313)."""
    # One slice per tensor covering all its windows, one copy of them all, one gather of the window bytes:
    # Python slicing per window (4 a tensor) was the cost, not the bytes.
    lo, hi = WINDOW_OFFSETS[0], WINDOW_OFFSETS[-1] + WINDOW
    spans, bases, counts, base = [], [], [], 0
    for flat in flats:
        es = flat.element_size()
        n = _n_windows(flat.numel() * es)
        if not n:
            continue
        end = min(hi, WINDOW_OFFSETS[n - 1] + WINDOW)
        spans.append(flat[lo // es: end // es])
        bases.append(base)
        counts.append(n)
        base += end - lo
    if not spans:
        return torch.zeros(0, dtype=torch.float64, device=flats[0].device if flats else "cpu")
    blob = torch.cat(spans).contiguous().view(torch.uint8)
    dev = blob.device
    pattern = torch.tensor([off - lo + k for off in WINDOW_OFFSETS for k in range(WINDOW)], device=dev)
    which = torch.arange(len(WINDOW_OFFSETS), device=dev).repeat_interleave(WINDOW)
    keep = which[None, :] < torch.tensor(counts, device=dev)[:, None]  # a tensor's windows that fit
    picks = (torch.tensor(bases, device=dev)[:, None] + pattern[None, :])[keep]
    return blob[picks].to(torch.float64)


def _plain(flat: torch.Tensor) -> list[torch.Tensor]:
    """The plain path's device parts: 6 stats, 2 fingerprint lanes, head, raw bytes (windows: per
    group of same-dtype tensors, by ``_windows_many``)."""
    with torch.no_grad():
        stats, head = _stats(flat)
        h1, h2 = _fingerprint_lanes(flat)
        raw_n = _raw_len(flat.numel() * flat.element_size())
        es = flat.element_size()
        raw = flat[: (raw_n + es - 1) // es].contiguous().view(torch.uint8)[:raw_n]
        dev = flat.device
        return [torch.stack([s.to(dev, torch.float64) for s in (*stats, h1, h2)]), head.to(torch.float64),
                raw.to(torch.float64)]


# -- the fused path (CUDA + Triton) ---------------------------------------------------
_FUSED_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_TRITON: dict[str, Any] = {}
WORDS_PER_ITER = 2048  # words one program reads per loop iteration
ITERS = 16  # iterations per program: 128 KiB of tensor per program (best of a sweep on an H200)
NUM_WARPS = 8
_KERNEL_EVENTS: list | None = None  # benchmarks set a list: (start, end) CUDA events around each probe kernel


def fused_enabled() -> bool:
    """Whether CUDA tensors can take the fused Triton pass (env WORKBENCH_PROBE_FUSED=0 turns it off)."""
    if os.environ.get("WORKBENCH_PROBE_FUSED", "1") == "0":
        return False
    if "ok" not in _TRITON:
        try:
            _TRITON.update(_build_kernels())
            _TRITON["ok"] = True
        except Exception as exc:  # no Triton, or it cannot build here: the plain path stays correct
            _TRITON["ok"] = False
            _TRITON["why"] = f"{type(exc).__name__}: {exc}"
    return bool(_TRITON["ok"])


FUSED_DEVICES = ("cuda",)  # tests add "cpu" to run the kernels through Triton's interpreter


def _fusable(t: torch.Tensor) -> bool:
    return (t.device.type in FUSED_DEVICES and t.dtype in _FUSED_KINDS and t.is_contiguous()
            and t.data_ptr() % 16 == 0 and (t.numel() * t.element_size()) % 4 == 0)


def _build_kernels() -> dict[str, Any]:
    import _probe_reference_triton as k  # the kernels as they were (benchmarks/ on the path)

    return {"probe": k.probe_kernel, "raw": k.raw_kernel, "hint": True}


def _fused(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 8] float64 stats+lanes and [T, 64] raw words for same-dtype fusable CUDA tensors."""
    dev = tensors[0].device
    dtype = tensors[0].dtype
    per = WORDS_PER_ITER * ITERS
    ptrs, nw, nblk = [], [], []
    for t in tensors:
        n = t.numel() * t.element_size() // 4
        ptrs.append(t.data_ptr())
        nw.append(n)
        nblk.append((n + per - 1) // per)
    total = sum(nblk)
    firsts = [0] * len(tensors)
    acc = 0
    for i, b in enumerate(nblk):
        firsts[i] = acc
        acc += b
    T = len(tensors)
    table = torch.tensor(ptrs + nw + firsts + nblk, dtype=torch.int64).to(dev, non_blocking=True)
    ptr_d, nw_d, first_d, nblk_d = table[:T], table[T:2 * T], table[2 * T:3 * T], table[3 * T:]
    blk_t = torch.repeat_interleave(torch.arange(T, device=dev), nblk_d, output_size=total)
    part_f = torch.empty((total, 3), dtype=torch.float32, device=dev)
    part_i = torch.empty((total, 5), dtype=torch.int64, device=dev)
    kind = _FUSED_KINDS[dtype]
    poison_bits = POISON_BITS[dtype][1]
    probe_kernel = _TRITON["probe"]
    timing = _KERNEL_EVENTS is not None and dev.type == "cuda"
    with torch.cuda.device(dev) if dev.type == "cuda" else _nullcontext():
        if timing:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        try:
            _TRITON["last"] = probe_kernel[(total,)](
                ptr_d, nw_d, first_d, blk_t, part_f, part_i, POISON=poison_bits, KIND=kind,
                BLOCK=WORDS_PER_ITER, ITERS=ITERS, HINT=_TRITON["hint"], num_warps=NUM_WARPS)
        except Exception:
            if not _TRITON["hint"]:
                raise
            _TRITON["hint"] = False  # this Triton refuses the alignment hint: go without it
            _TRITON["last"] = probe_kernel[(total,)](
                ptr_d, nw_d, first_d, blk_t, part_f, part_i, POISON=poison_bits, KIND=kind,
                BLOCK=WORDS_PER_ITER, ITERS=ITERS, HINT=False, num_warps=NUM_WARPS)
        if timing:
            ev1.record()
            _KERNEL_EVENTS.append((ev0, ev1))
        raw = torch.empty((T, RAW_SMALL // 4), dtype=torch.int64, device=dev)
        _TRITON["raw"][(T,)](ptr_d, nw_d, raw, WORDS=RAW_SMALL // 4, num_warps=1)
    lo = torch.full((T,), math.inf, dtype=torch.float32, device=dev).scatter_reduce_(
        0, blk_t, part_f[:, 0], "amin")
    hi = torch.full((T,), -math.inf, dtype=torch.float32, device=dev).scatter_reduce_(
        0, blk_t, part_f[:, 1], "amax")
    s = torch.zeros(T, dtype=torch.float64, device=dev).index_add_(0, blk_t, part_f[:, 2].double())
    ints = torch.zeros((T, 5), dtype=torch.int64, device=dev).index_add_(0, blk_t, part_i)
    per_word = 4 // tensors[0].element_size()
    nfin = (nw_d * per_word - ints[:, 0] - ints[:, 1]).double()
    some = nfin > 0
    nanv = torch.full_like(s, math.nan)
    mean = torch.where(some, s / nfin.clamp(min=1), nanv)
    lo = torch.where(some, lo.double(), nanv)
    hi = torch.where(some, hi.double(), nanv)
    h = (ints[:, 3:5] & _M32).double()
    stats = torch.stack([ints[:, 0].double(), ints[:, 1].double(), ints[:, 2].double(), lo, hi, mean,
                         h[:, 0], h[:, 1]], dim=1)
    return stats, raw


# -- rows -----------------------------------------------------------------------------
_DEVICE_NAMES: dict[torch.device, str] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def probe_tensors(items: Iterable[tuple[str, str, torch.Tensor]], rank: int) -> list[dict[str, Any]]:
    """Summaries of (name, kind, tensor) triples; one host sync for all of them."""
    rows: list[dict[str, Any]] = []
    plain: list[tuple[dict[str, Any], torch.Tensor]] = []
    fused: dict[tuple[torch.device, torch.dtype], list[tuple[dict[str, Any], torch.Tensor]]] = {}
    use_fused = None
    dev_names = _DEVICE_NAMES
    for name, kind, t in items:
        t = _local(t)
        meta = t.is_meta
        dev = t.device
        dev_name = dev_names.get(dev)
        if dev_name is None:
            dev_name = dev_names[dev] = str(dev)
        row = {
            "rank": rank, "name": name, "kind": kind, "dtype": _dtype_name(t.dtype),
            "device": dev_name, "is_meta": meta, "shape": "x".join(map(str, t.shape)) or "()",
            "numel": t.numel(),
        }
        rows.append(row)
        if meta or row["numel"] == 0 or t.is_complex():
            row.update(_NO_DATA, fingerprint="meta" if meta else "empty", raw="", windows="")
            continue
        if t.device.type in FUSED_DEVICES:
            if use_fused is None:
                use_fused = fused_enabled()
            if use_fused and _fusable(t):
                fused.setdefault((t.device, t.dtype), []).append((row, t))
                continue
        plain.append((row, t.reshape(-1)))
    if not plain and not fused:
        return rows
    parts: list[torch.Tensor] = []
    for _, flat in plain:
        parts += _plain(flat)
    plain_groups: dict[tuple[torch.device, torch.dtype], list[tuple[dict[str, Any], torch.Tensor]]] = {}
    for row, flat in plain:
        plain_groups.setdefault((flat.device, flat.dtype), []).append((row, flat))
    with torch.no_grad():
        parts += [_windows_many([f for _, f in members]) for members in plain_groups.values()]
    groups = []
    for (_dev, dtype), members in fused.items():
        stats, raw = _fused([t for _, t in members])
        groups.append((dtype, members))
        parts += [stats.reshape(-1), raw.double().reshape(-1)]
        parts.append(_windows_many([t.reshape(-1) for _, t in members]))
    host = _to_host(parts)
    pos = 0
    for row, flat in plain:
        s = host[pos: pos + 8].tolist()
        pos += 8
        n_head = min(HEAD, row["numel"])
        head = host[pos: pos + n_head].tolist()
        pos += n_head
        n_raw = _raw_len(row["numel"] * flat.element_size())
        raw = host[pos: pos + n_raw].astype("uint8").tobytes()
        pos += n_raw
        _fill(row, s, head, raw)
    for members in plain_groups.values():
        for row, flat in members:
            n_win = _n_windows(row["numel"] * flat.element_size()) * WINDOW
            row["windows"] = host[pos: pos + n_win].astype("uint8").tobytes().hex()
            pos += n_win
    for dtype, members in groups:
        T = len(members)
        stats = host[pos: pos + 8 * T]
        pos += 8 * T
        words = host[pos: pos + (RAW_SMALL // 4) * T]
        pos += (RAW_SMALL // 4) * T
        _fill_fused(members, dtype, stats, words)
        for row, t in members:
            n_win = _n_windows(t.numel() * t.element_size()) * WINDOW
            row["windows"] = host[pos: pos + n_win].astype("uint8").tobytes().hex()
            pos += n_win
    return rows


def _fill(row: dict[str, Any], s: list[float], head: list[float], raw: bytes) -> None:
    row.update(nan=int(s[0]), inf=int(s[1]), poisoned=int(s[2]), min=float(s[3]), max=float(s[4]),
               mean=float(s[5]), head=head, fingerprint=f"{int(s[6]):08x}{int(s[7]):08x}", raw=raw.hex())


def _fill_fused(members: list[tuple[dict[str, Any], torch.Tensor]], dtype: torch.dtype, stats: list[float],
                words: list[float]) -> None:
    import numpy as np

    T = len(members)
    wpr = RAW_SMALL // 4
    w = np.asarray(words).astype(np.uint32).reshape(T, wpr)
    blob = w.tobytes()  # little-endian words: the tensors' first bytes
    es = torch.empty((), dtype=dtype).element_size()
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(dtype)
    if dtype == torch.bfloat16:
        u16 = w[:, : HEAD // 2].view(np.uint16).astype(np.uint32) << 16  # first 8 bf16 values
        heads = u16.view(np.float32).astype(np.float64)
    else:
        heads = w[:, : HEAD * es // 4].copy().view(np_dtype).astype(np.float64)
    heads_l = heads.tolist()
    # Column-wise conversions, then plain item assignment: at 313 tensors the per-row
    # float()/int()/format calls were most of the probe's Python time.
    st = np.asarray(stats).reshape(T, 8)
    counts = st[:, :3].astype(np.int64).tolist()
    floats = st[:, 3:6].tolist()
    fps = ((st[:, 6].astype(np.uint64) << np.uint64(32)) | st[:, 7].astype(np.uint64)).tolist()
    row_bytes = RAW_SMALL
    for i, (row, _) in enumerate(members):
        numel = row["numel"]
        row["nan"], row["inf"], row["poisoned"] = counts[i]
        row["min"], row["max"], row["mean"] = floats[i]
        row["head"] = heads_l[i][: min(HEAD, numel)]
        row["fingerprint"] = f"{fps[i]:016x}"
        row["raw"] = blob[i * row_bytes: i * row_bytes + _raw_len(numel * es)].hex()


def _to_host(parts: list[torch.Tensor]):
    """Every part in one float64 numpy array, after one device-to-host copy.

    On CUDA the copy is asynchronous into pinned memory and waited for by polling, never
    a blocking copy: a rank whose stream sits behind a stuck collective then reports it
    after the group's timeout instead of hanging inside the driver, where even the NCCL
    watchdog cannot get past it.
    """
    import numpy as np

    if not parts:
        return np.zeros(0)
    devices = {p.device for p in parts}
    if len(devices) > 1:
        parts = [p.cpu() for p in parts]
    buf = torch.cat(parts)
    if not buf.is_cuda:
        return buf.numpy()
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    host.copy_(buf, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(buf.device))
    _wait(done, buf.device)
    return host.numpy()


def _wait(event: torch.cuda.Event, device: torch.device) -> None:
    import time

    limit = _sync_limit()
    t0 = time.perf_counter()
    pause = 0.0
    while not event.query():
        waited = time.perf_counter() - t0
        if limit is not None and waited > limit:
            raise RuntimeError(
                f"probe: the work queued on {device} did not finish within {limit:g}s; a collective on this "
                "rank's stream is probably stuck (its peer never posted the matching call)")
        if waited > 0.002:
            pause = min(0.01, pause + 0.0002)
            time.sleep(pause)


def _sync_limit() -> float | None:
    """The process group's timeout on an engine rank; None (wait for ever) elsewhere."""
    env = os.environ.get("WORKBENCH_PROBE_SYNC_TIMEOUT")
    if env:
        return float(env)
    from workbench.rank import context

    t = context._RANK.get("timeout_s")
    return float(t) if t else None


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
