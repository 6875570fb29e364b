"""Per-rank tensor summaries: small rows out, never tensors.

All reductions run on the tensor's own device and land in one flat float64 buffer that
crosses to the host once, so a probe costs one sync whatever the number of tensors.
The row vocabulary (column names) is shared by frames, the CLI's JSON and bundles.

On CUDA, bf16/fp16/fp32 tensors are summarised by one fused pass (``probe_fused``): one
kernel (NVRTC's build, or Triton's where NVRTC cannot build) reads each byte once and
computes every statistic and the fingerprint, so probing a billion-parameter model costs
about one read of its memory. Everything else (CPU, other dtypes, odd sizes or alignments) takes the plain
torch path, which computes the same values (the fingerprint bit for bit).

The fingerprint hashes the tensor's bytes as little-endian 32-bit words (zero-padded to
a whole word): two 32-bit lanes, each the wrapping sum over words of a mix of the word and
its 1-based position. Equal bytes give equal fingerprints on any device; moving a word
changes it.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from itertools import repeat
from typing import Any, NamedTuple

import torch
from torch import nn

from workbench.rank import mesh_facts
from workbench.rank import probe_cpu as _pc
from workbench.rank import probe_fused as _pf
from workbench.rank.columns import COLUMNS, WINDOW, WINDOW_OFFSETS
from workbench.rank.fingerprint import _fingerprint_lanes
from workbench.rank.poison import poison_count
from workbench.rank.probe_fused import HEAD, RAW_LARGE, RAW_SMALL, fused_enabled  # noqa: F401  (re-exported)

_NO_DATA = {"nan": None, "inf": None, "poisoned": None, "min": None, "max": None, "mean": None, "head": []}


def named_tensors(module: nn.Module, prefix: str = "",
                  ties: dict[str, list[str]] | None = None) -> list[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) for every parameter and buffer, kind telling persistence apart.

    Parameters first (``named_parameters`` order and names, shared ones once), then buffers. ``ties`` gets,
    per parameter listed, the other names the same parameter is held under (a head tied to the embedding).
    """
    params: list[tuple[str, str, torch.Tensor]] = []
    bufs: list[tuple[str, str, torch.Tensor]] = []
    plain = type(module).named_parameters is nn.Module.named_parameters  # wrappers (FSDP) rename theirs
    if not plain:
        params = [(prefix + name, "parameter", partition(p)) for name, p in module.named_parameters()]
    seen: dict[int, str] = {}
    for mod_name, mod in module.named_modules():
        pre = f"{prefix}{mod_name}." if mod_name else prefix
        if plain:
            for local, p in mod._parameters.items():
                if p is None:
                    continue
                first = seen.get(id(p))
                if first is not None:
                    if ties is not None:
                        ties.setdefault(first, []).append(pre + local)
                    continue
                seen[id(p)] = pre + local
                params.append((pre + local, "parameter", partition(p)))
        if mod._buffers:
            nonpers = mod._non_persistent_buffers_set
            for local, b in mod._buffers.items():
                if b is not None:
                    bufs.append((pre + local, "non-persistent buffer" if local in nonpers else "buffer", b))
    return params + bufs


def partition(p: torch.Tensor) -> torch.Tensor:
    """A parameter as the probe reads it: ZeRO-3's partitioned parameter (``ds_id``; empty outside the forward that
    gathers it) through ``ds_tensor``, this rank's flat partition of it, always (gathered or not: a shard, never
    compared whole across ranks, ``agree.of_tensor``); any other tensor as it is. Keyed on the attributes ZeRO
    puts on the parameter, not on an import of DeepSpeed."""
    held = p.__dict__
    part = held.get("ds_tensor") if "ds_id" in held else None
    return part if isinstance(part, torch.Tensor) else p


# Set while a rank serves beside a main thread stuck in a collective (the job's post mortem on GPUs): that thread's
# launches wait behind the collective and hold the CUDA context, so a device allocation (the fused plan, any
# kernel's output) would wait for ever. Tensors are then read by copies to the host on the serving thread's own
# stream, each in a thread of its own that the probe gives up on (one line) if the GPU does not answer.
_HOST_READ: dict[str, Any] = {}


def read_by_host_copies(stream: Any, limit: float = 5.0) -> None:
    """From now on this process's probe reads GPU tensors by host copies on ``stream`` (see ``_HOST_READ``)."""
    _HOST_READ.update(stream=stream, limit=float(limit))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    import threading

    box: dict[str, Any] = {}
    stream, limit = _HOST_READ["stream"], _HOST_READ["limit"]

    def copy() -> None:
        try:
            torch.cuda.set_device(t.device)  # a new thread starts on device 0 with the default stream
            if stream is not None and stream.device == t.device:
                torch.cuda.set_stream(stream)
            box["t"] = t.to("cpu")
        except BaseException as exc:  # a thread's boundary: whatever the copy raised is raised in the probe's caller
            box["exc"] = exc

    worker = threading.Thread(target=copy, name="workbench-host-copy", daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise TimeoutError(f"{t.device} did not answer a copy of a {list(t.shape)} tensor in {limit:.0f} s: this "
                           "rank's main thread holds the GPU (its launches wait behind the stuck collective); "
                           "host-side cells still work")
    if "exc" in box:
        raise box["exc"]
    return box["t"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        held = getattr(t, "_local_tensor", None)  # a DTensor's own shard: ``to_local`` is an autograd call (25 us)
        if isinstance(held, torch.Tensor):
            return held.detach()
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


_raw_len = _pf.raw_len
_n_windows = _pf.n_windows


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


def _plain(flat: torch.Tensor, sumsq_here: bool = False) -> list[torch.Tensor]:
    """The plain path's device parts: 6 stats, 2 fingerprint lanes, the sum of squares where ``sumsq_here`` (else
    0: a CPU tensor's is the batched CPU pass's, ``probe_cpu.sumsq``), head, raw bytes (windows: per group of
    same-dtype tensors, by ``_windows_many``). On a GPU the sum of squares rides in the one copy back: read alone
    it was a sync a tensor (146 of them at a job's first point, while the probe's kernel still builds)."""
    with torch.no_grad():
        stats, head = _stats(flat)
        h1, h2 = _fingerprint_lanes(flat)
        raw_n = _raw_len(flat.numel() * flat.element_size())
        es = flat.element_size()
        raw = flat[: (raw_n + es - 1) // es].contiguous().view(torch.uint8)[:raw_n]
        dev = flat.device
        sq = _sumsq_device(flat) if sumsq_here else torch.zeros((), device=dev, dtype=torch.float64)
        return [torch.stack([s.to(dev, torch.float64) for s in (*stats, h1, h2, sq)]), head.to(torch.float64),
                raw.to(torch.float64)]


# -- rows -----------------------------------------------------------------------------
_DEVICE_NAMES: dict[torch.device, str] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _device_name(dev: torch.device) -> str:
    name = _DEVICE_NAMES.get(dev)
    if name is None:
        name = _DEVICE_NAMES[dev] = str(dev)
    return name


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def probe_tensors(items: Iterable[tuple[str, str, torch.Tensor]], rank: int, memo: dict | None = None,
                  held: list[tuple[str, torch.Tensor]] | None = None,
                  same: dict[tuple, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Summaries of (name, kind, tensor) triples; one host sync for all of them. ``memo``, shared by calls: a
    tensor already summarised there (the same memory read as the same dtype and shape: a wrapper and the
    module it wraps, both in a step's objects) takes that row's values instead of a second pass. ``held``
    gets each (name, tensor) as given, for whoever reads the same tensors after (``remote._annotate``).
    ``same`` gets the rows per memory (address, dtype, shape, device): names that share storage."""
    rows: list[dict[str, Any]] = []
    copies: list[tuple[dict[str, Any], dict[str, Any]]] = []
    plain: list[tuple[dict[str, Any], torch.Tensor]] = []
    fused: dict[torch.device, list[tuple[dict[str, Any], torch.Tensor]]] = {}
    use_fused = None
    layouts: list[tuple[int, dict[str, str]]] = []
    for name, kind, t in items:
        if held is not None:
            held.append((name, t))
        if type(t) is not torch.Tensor and type(t) is not nn.Parameter and hasattr(t, "placements"):
            layouts.append((len(rows), _layout(t)))  # the index its row is about to take
        t = _local(t)
        meta = t.is_meta
        dev = t.device
        row = _fixed_row(rank, name, kind, t)
        rows.append(row)
        if meta or row["numel"] == 0 or t.is_complex():
            row.update(_NO_DATA, fingerprint="meta" if meta else "empty", raw="", windows="", sumsq=None)
            continue
        if (memo is not None or same is not None) and t.data_ptr():
            key = (t.data_ptr(), t.dtype, t.shape, t.stride(), dev)
            if same is not None:
                same.setdefault(key, []).append(row)
            if memo is not None:
                if key in memo:
                    copies.append((row, memo[key]))
                    continue
                memo[key] = row
        if _HOST_READ and t.is_cuda:
            t = _host_copy(t)
            dev = t.device
        if dev.type in _pf.FUSED_DEVICES:
            if use_fused is None:
                use_fused = fused_enabled()
            if use_fused and _pf.fusable(t):
                fused.setdefault(dev, []).append((row, t))
                continue
        plain.append((row, t.reshape(-1)))
    plans = [(members, _pf.plan_for([t for _, t in members])) for members in fused.values()]
    for _, plan in plans:
        plan.launch()  # the kernels run while the plain path below queues its own work
    if plain:
        batched = list(map(_pc.batchable, (flat for _, flat in plain)))
        plain = _pc.fill([m for m, b in zip(plain, batched) if b]) + [m for m, b in zip(plain, batched) if not b]
    if plain:
        _probe_plain(plain)
    for members, plan in plans:
        fill([row for row, _ in members], plan.columns())
    for row, src in copies:
        row.update({key: src[key] for key in _STAT_COLUMNS}, head=list(src["head"]))
    for i, layout in layouts:  # after the statistics: a DTensor's row ends with its layout
        rows[i].update(layout)
    return rows


def _fixed_row(rank: int, name: str, kind: str, t: torch.Tensor) -> dict[str, Any]:
    """A row's columns before its statistics (``t``: the local tensor)."""
    return {"rank": rank, "name": name, "kind": kind, "dtype": _dtype_name(t.dtype), "device": _device_name(t.device),
            "is_meta": t.is_meta, "shape": "x".join(map(str, t.shape)) or "()", "numel": t.numel()}


def fill(rows: list[dict[str, Any]], cols: dict[str, list]) -> None:
    """A launch's statistics into its rows (``Plan.columns``: one list per column, in row order), column by column, a
    C loop each: keys land in COLUMNS order."""
    for name in _STAT_COLUMNS:
        deque(map(operator.setitem, rows, repeat(name), cols[name]), maxlen=0)


def _layout(t: Any) -> dict[str, str]:
    """A DTensor's whole shape and placements (``Shard(dim=0)``, ``Replicate()``, one per mesh dimension, with
    the mesh's shape): what its rows' local ``shape`` is a piece of; and this rank's coordinate on that mesh."""
    try:
        mesh = t.device_mesh
        key = (id(mesh), tuple(t.placements))
        hit = _PLACEMENTS.get(key)
        if hit is None or hit[0] is not mesh:
            facts = mesh_facts.of(mesh)
            placed = (", ".join(f"{d}={p}" for d, p in zip(facts.names, t.placements))
                      + f" on mesh {'x'.join(map(str, facts.shape))}")
            # where this rank sits on that mesh (``replicate=1, shard=0``): what the views order ranks by
            coord = ", ".join(f"{d}={c}" for d, c in zip(facts.names, facts.coord)) if facts.coord is not None else ""
            hit = _PLACEMENTS[key] = (mesh, placed, coord)
        return {"global_shape": "x".join(map(str, t.shape)) or "()", "placement": hit[1], "mesh_coord": hit[2]}
    except (AttributeError, TypeError, RuntimeError):  # a subclass only like a DTensor: its local rows stand alone
        return {}


_PLACEMENTS: dict[tuple, tuple[Any, str, str]] = {}  # (mesh, placements) -> placement, mesh_coord: asked per tensor


_STAT_COLUMNS = COLUMNS[COLUMNS.index("nan"):]
# A packed row's statistics as placeholders, filled in place: a row copied with every key it will hold is filled
# without growing (a copy of the 8 fixed keys grew its table once per row as the statistics went in)
_UNFILLED = dict.fromkeys(_STAT_COLUMNS)


def _probe_plain(plain: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
    """The plain torch path's rows: its device parts, one copy to the host, then per-row values."""
    parts: list[torch.Tensor] = []
    for _, flat in plain:
        parts += _plain(flat, flat.device.type != "cpu")
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[dict[str, Any], torch.Tensor]]] = {}
    for row, flat in plain:
        groups.setdefault((flat.device, flat.dtype), []).append((row, flat))
    with torch.no_grad():
        parts += [_windows_many([f for _, f in members]) for members in groups.values()]
    host = _to_host(parts)
    pos = 0
    sums: dict[int, float] = {}  # id(row) -> its sum of squares as the device summed it
    for row, flat in plain:
        s = host[pos: pos + 9].tolist()
        sums[id(row)] = s[8]
        pos += 9
        n_head = min(HEAD, row["numel"])
        head = host[pos: pos + n_head].tolist()
        pos += n_head
        n_raw = _raw_len(row["numel"] * flat.element_size())
        raw = host[pos: pos + n_raw].astype("uint8").tobytes()
        pos += n_raw
        _fill(row, s, head, raw)
    for members in groups.values():
        for row, flat in members:
            n_win = _n_windows(row["numel"] * flat.element_size()) * WINDOW
            row["windows"] = host[pos: pos + n_win].astype("uint8").tobytes().hex()
            row["sumsq"] = _sumsq(flat) if flat.device.type == "cpu" else sums[id(row)]
            pos += n_win


def _sumsq(flat: torch.Tensor) -> float:
    """The sum of squares of the finite values, float64: on CPU as the batched pass sums it (``probe_cpu.sumsq``);
    elsewhere (a GPU tensor the fused pass does not take: float64, integers, odd sizes) one reduction there."""
    x = flat if flat.dtype == torch.float64 else flat.float()
    if x.device.type == "cpu":
        return _pc.sumsq(x)
    return float(_sumsq_device(flat))


def _sumsq_device(flat: torch.Tensor) -> torch.Tensor:
    """``_sumsq`` of a tensor off the CPU, as a 0-d float64 tensor on its device (no sync)."""
    x = flat if flat.dtype == torch.float64 else flat.float()
    with torch.no_grad():
        x = x.double()
        return torch.where(torch.isfinite(x), x, 0.0).square().sum()


def _fill(row: dict[str, Any], s: list[float], head: list[float], raw: bytes) -> None:
    row.update(nan=int(s[0]), inf=int(s[1]), poisoned=int(s[2]), min=float(s[3]), max=float(s[4]),
               mean=float(s[5]), head=head, fingerprint=f"{int(s[6]):08x}{int(s[7]):08x}", raw=raw.hex())


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
    _pf.wait(done, buf.device)
    return host.numpy()


# -- the packed path: a module whose every tensor is fusable, its plan cached -----------
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLAIN_TYPES = frozenset({torch.Tensor, nn.Parameter})
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


def probe_module(module: nn.Module, rank: int, prefix: str = "", memo: dict | None = None,
                 held: list[tuple[str, torch.Tensor]] | None = None) -> list[dict[str, Any]]:
    """``probe_tensors`` over ``named_tensors(module)``; when every tensor takes the fused pass, through a
    plan cached for this module (one launch, one copy back, rows from arrays).

    A row whose tensor the module also holds under other names (a tied parameter, two names for one memory)
    says so in ``shares`` (those names, comma-joined); rows of tensors held once carry no such key."""
    if not _HOST_READ and ("cpu" in _pf.FUSED_DEVICES or torch.cuda.is_initialized()):
        rows = _packed(module, rank, prefix, held)
        if rows is not None:
            return rows
    ties: dict[str, list[str]] = {}
    same: dict[tuple, list[dict[str, Any]]] = {}
    rows = probe_tensors(named_tensors(module, prefix, ties), rank, memo, held, same)
    _mark_shares(rows, ties, same)
    return rows


def _shares(names: list[str], ties: dict[str, list[str]], same: dict[tuple, list[str]]) -> dict[int, str]:
    """Row index -> the other names its tensor is held under: ties (one parameter in two modules) and rows
    whose tensors are the same memory read alike (address, dtype, shape); only rows that share."""
    at = {n: i for i, n in enumerate(names)}
    out: dict[int, list[str]] = {}
    for first, others in ties.items():
        if first in at:
            out.setdefault(at[first], []).extend(others)
    for group in same.values():
        if len(group) > 1:
            for n in group:
                if n in at:
                    out.setdefault(at[n], []).extend(o for o in group if o != n)
    return {i: ",".join(dict.fromkeys(v)) for i, v in out.items()}


def _mark_shares(rows: list[dict[str, Any]], ties: dict[str, list[str]],
                 same: dict[tuple, list[dict[str, Any]]]) -> None:
    if not ties and all(len(g) < 2 for g in same.values()):
        return  # the common case: nothing shared, rows untouched
    names = [r["name"] for r in rows]
    for i, v in _shares(names, ties, {k: [r["name"] for r in g] for k, g in same.items()}).items():
        rows[i]["shares"] = v


def _packed(module: nn.Module, rank: int, prefix: str,
            held: list[tuple[str, torch.Tensor]] | None = None) -> list[dict[str, Any]] | None:
    """The module's rows through its cached plan, or None where the general path must run.

    The cache key is what the rows' fixed columns and the descriptor table depend on: the module tree (every
    module's parameter, buffer and child dicts: their keys and the identity of each value, the non-persistent
    sets) and each tensor's address, shape, dtype and contiguity. It is read from the plan's own list of the
    tree's modules, by C loops, not by a walk that names anything (~0.1 ms for 148 tensors where the walk took
    1.5 ms of an H200 host's point): a tree that changed anywhere changes some dict the list holds. A key that
    differs rebuilds the plan from ``named_tensors``."""
    stamp = _PHASES.append if _PHASES is not None else None
    fit = fit_and_launch(module, prefix)
    if fit is None:
        return None
    if stamp:
        stamp(("tree key", time.perf_counter()))
    return _rows(fit[0], rank, fit[1], held, stamp)


def fit_and_launch(module: nn.Module, prefix: str) -> tuple[_Entry, Any] | None:
    """The module's plan, launched (its entry and the launch's slot); None: the general path.

    The cached plan is launched as soon as its tensors are known to be alive where it reads them, with the shapes
    and dtypes it was built for (``_tensor_key``: what makes the read safe), and the tree is checked while the
    kernel runs (``_tree_key``: what makes the rows' names right; 1.4 ms of a point on an H200 host just after a
    step, ~0.6 ms of kernel behind it). A tree that changed rebuilds the plan, which is launched again."""
    if type(module).named_parameters is not nn.Module.named_parameters or not fused_enabled():
        return None
    cached = _PLANS.get(module)
    try:
        if cached is not None and cached.entry is not None and cached.key[0] == prefix:
            if cached.key[2] == _tensor_key(cached.whole, cached.plain):
                if _PHASES is not None:
                    _PHASES.append(("tensor key", time.perf_counter()))
                slot = cached.entry.plan.launch()
                if _PHASES is not None:
                    _PHASES.append(("launched", time.perf_counter()))
                if cached.key[1] == _tree_key(cached.mods):
                    return cached.entry, slot
        elif cached is not None and cached.key[0] == prefix and cached.key[1] == _tree_key(cached.mods):
            if cached.key[2] == _tensor_key(cached.whole, cached.plain):
                return None  # the general path, as decided for this very tree and these tensors
        cached = _cache(module, prefix)
    except RuntimeError:  # a tensor without storage (data_ptr refused): the general path
        return None
    _PLANS[module] = cached
    return None if cached.entry is None else (cached.entry, cached.entry.plan.launch())


def _rows(entry: _Entry, rank: int, slot: list, held: list | None = None, stamp: Any = None) -> list[dict[str, Any]]:
    """A launched plan's rows: the fixed columns, then the statistics once each part's copy is back (``slot``: the
    parts' slots, as ``Parts.launch`` gave them)."""
    fixed = entry.fixed.get(rank)
    if fixed is None:  # the rows' fixed columns once per plan and rank; each point copies them (a C loop, 3x faster)
        fixed = entry.fixed[rank] = [{"rank": rank, "name": n, "kind": k, "dtype": d, "device": dv, "is_meta": False,
                                      "shape": sh, "numel": ne, **_UNFILLED} for n, k, d, dv, sh, ne in entry.static]
    rows = list(map(dict.copy, fixed))
    for (plan, at), part_slot in zip(entry.plan.parts, slot):  # the first part's rows while the second's kernel runs
        fill(rows if len(at) == len(rows) else [rows[i] for i in at], plan.columns(stamp, part_slot))
    for i, layout in entry.layouts.items():  # a DTensor row: its layout, then its shares (the general path)
        rows[i].update(layout)
    for i, v in entry.shares.items():  # shared tensors (ties), known when the plan was built: none in most models
        rows[i]["shares"] = v
    if held is not None:  # the module's (name, tensor) pairs, as named_tensors gives them, for the annotations
        held.extend(zip(entry.names, map(weakref.ref.__call__, entry.whole)))
    if stamp:
        stamp(("rows filled", time.perf_counter()))
    return rows


_DICTS = operator.attrgetter("_parameters", "_buffers", "_modules")
_NONPERSISTENT = operator.attrgetter("_non_persistent_buffers_set")


def _tree_key(mods: list) -> tuple | None:
    """The tree ``mods`` (weak refs to each module once, ``modules()`` order) holds now: every dict's size, then the
    keys and the identity of every value of those not empty (a parameter set to another, a child swapped, a buffer
    registered, a parameter moved to the buffers or to the next module), the non-persistent sets (live: ``_frozen``
    keeps the cached key's own). None where a module is gone. Most of a model's dicts are empty (a leaf's children,
    most modules' buffers): their values are not walked. Qwen3-1.7B's 427 modules: 0.26 ms here where it was 0.45, and
    on an H200 host, timed by turns, 0.46 where it was 0.54 (fixtures/gpu/probe_micro_1gpu.txt)."""
    live = list(map(weakref.ref.__call__, mods))
    if None in live:
        return None
    dicts = list(itertools.chain.from_iterable(map(_DICTS, live)))
    held = list(filter(None, dicts))
    return (list(map(len, dicts)), list(itertools.chain.from_iterable(held)),
            list(map(id, itertools.chain.from_iterable(map(dict.values, held)))), list(map(_NONPERSISTENT, live)))


def _frozen(key: tuple | None) -> tuple | None:
    """A tree key to keep: the non-persistent sets copied (the live ones would compare equal to themselves)."""
    return None if key is None else (*key[:3], list(map(frozenset, key[3])))


def _tensor_key(whole: list, plain: bool) -> tuple | None:
    """Where the module's tensors are now (read once their identities matched, so each is the one held when the
    plan was built, unless it died and another took its id: then a weak ref is dead and the key differs): the
    local shards' addresses, shapes, dtypes and contiguity (``p.data = ...``, as ``module.to`` does, keeps the
    identity, not these). None where a subclass other than DTensor is among them."""
    held = list(map(weakref.ref.__call__, whole))
    local = held if plain else _shards(held)
    if local is None:
        return None
    try:
        return (list(map(torch.Tensor.data_ptr, local)), list(map(_shape, local)), list(map(_dtype, local)),
                list(map(torch.Tensor.is_contiguous, local)))
    except TypeError:  # a weak ref dead (None): not the tensors the plan was built for
        return ("gone",)


class _Cached(NamedTuple):
    """A module's entry in ``_PLANS``: its plan (None: the general path) and what says it still fits."""

    key: tuple  # prefix, ``_tree_key``, ``_tensor_key``
    entry: Any  # _Entry | None
    mods: list  # weak refs to the tree's modules, each once, ``modules()`` order (the cache must not hold its key)
    whole: list  # weak refs to its tensors as named_tensors gives them
    plain: bool  # no tensor subclass among them


def _cache(module: nn.Module, prefix: str) -> _Cached:
    mods = list(map(weakref.ref, module.modules()))
    ties: dict[str, list[str]] = {}
    named = named_tensors(module, prefix, ties)
    whole = [weakref.ref(t) for _, _, t in named]
    plain = all(type(t) in _PLAIN_TYPES for _, _, t in named)
    key = (prefix, _frozen(_tree_key(mods)), _tensor_key(whole, plain))
    return _Cached(key, _build_plan(module, named, ties, whole) if key[2] is not None else None, mods, whole, plain)


_SERIAL = itertools.count(1)  # plans' serial numbers (``plan_stamp``)
_PHASES: list | None = None  # benchmarks set a list: (phase, perf_counter) stamps of the packed path


def plan_stamp(objects: Mapping[str, Any]) -> tuple | None:
    """A key the same only while each module among ``objects`` keeps the tree and tensors its cached plan was
    built for (each plan has a serial number of its own); None where a module has no plan (the general path:
    nothing vouches for it)."""
    out = []
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            cached = _PLANS.get(obj)
            if cached is None or cached.entry is None:
                return None
            out.append((name, id(obj), cached.entry.serial))
    return tuple(out)


class _Entry(NamedTuple):
    """A module's cached plan and what its rows take from it without a walk."""

    plan: Any  # probe_fused.Parts: the launch (one plan, or two past SPLIT_BYTES)
    static: list[tuple]  # per row: name, kind, dtype, device, shape, numel
    shares: dict[int, str]  # row -> the other names its tensor is held under
    layouts: dict[int, dict[str, str]]  # row -> a DTensor's layout columns
    names: list[str]  # the rows' names, as named_tensors gives them
    whole: list  # weak refs to the tensors as the module holds them (DTensors whole): the annotations' pairs
    serial: int  # this plan's own number (``plan_stamp``)
    fixed: dict  # rank -> the rows' fixed columns, made once (``_rows`` copies them)


def _build_plan(module: nn.Module, named: list[tuple[str, str, torch.Tensor]], ties: dict[str, list[str]],
                whole: list) -> _Entry | None:
    if any("ds_id" in p.__dict__ for p in module.parameters()):
        return None  # ZeRO-3's partitions are read in their parameters' place: the cache key names the parameters
    items = [(name, kind, _local(t)) for name, kind, t in named]
    if not items or not all(map(_pf.fusable, (t for _, _, t in items))) or len({t.device for _, _, t in items}) > 1:
        return None
    static = [(name, kind, _dtype_name(t.dtype), _device_name(t.device), "x".join(map(str, t.shape)) or "()",
               t.numel()) for name, kind, t in items]
    locs = [t for _, _, t in items]
    same: dict[tuple, list[str]] = {}
    for name, _, t in items:
        same.setdefault((t.data_ptr(), t.dtype, t.shape, t.stride(), t.device), []).append(name)
    shares = _shares([n for n, _, _ in items], ties, same)  # the cache key holds every tensor's identity and address
    layouts = {i: _layout(t) for i, (_, _, t) in enumerate(named) if type(t) not in _PLAIN_TYPES}
    return _Entry(_pf.Parts(locs), static, shares, layouts, [n for n, _, _ in named], whole, next(_SERIAL), {})


def _shards(tensors: list) -> list | None:
    """Each DTensor's local shard in its place (FSDP2's and TP's parameters), plain tensors as they are; None where
    another subclass is among them."""
    from torch.distributed.tensor import DTensor

    out = []
    for t in tensors:
        if type(t) in _PLAIN_TYPES:
            out.append(t)
        elif isinstance(t, DTensor):
            out.append(t._local_tensor)
        else:
            return None
    return out


def probe_dict(tensors: Mapping[str, torch.Tensor], rank: int, prefix: str = "",
               kind: str = "tensor", memo: dict | None = None) -> list[dict[str, Any]]:
    return probe_tensors(((prefix + k, kind, v) for k, v in tensors.items() if isinstance(v, torch.Tensor)), rank,
                         memo)


def probe_objects(objects: Mapping[str, Any], rank: int,
                  held: dict[str, list[tuple[str, torch.Tensor]]] | None = None) -> list[dict[str, Any]]:
    """Probe every nn.Module and dict of tensors among ``objects``, names prefixed by key. ``held``: per
    module key, its (name, tensor) pairs as ``named_tensors`` gave them, where the probe walked the module
    (the packed GPU path does not: its plan already knows the rows)."""
    rows: list[dict[str, Any]] = []
    memo: dict = {}  # a tensor two objects hold (a model and its FSDP wrapper) is read once
    for key, obj in objects.items():
        if isinstance(obj, nn.Module):
            pairs: list[tuple[str, torch.Tensor]] | None = [] if held is not None else None
            rows += probe_module(obj, rank, prefix=f"{key}.", memo=memo, held=pairs)
            if pairs:
                held[key] = pairs
        elif isinstance(obj, Mapping) and any(isinstance(v, torch.Tensor) for v in obj.values()):
            rows += probe_dict(obj, rank, prefix=f"{key}.", memo=memo)
        elif isinstance(obj, torch.Tensor):
            rows += probe_tensors([(key, "tensor", obj)], rank, memo)
    return rows
