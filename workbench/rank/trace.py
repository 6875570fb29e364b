"""Forward trace: what every module's output looked like, per rank, during one forward.

``with trace_forward(ctx, model): model(...)`` puts a forward hook on every submodule of
``model``; each call leaves one small row (NaN/Inf counts of its inputs and outputs,
absmax, mean |x|, a content fingerprint), never a tensor. The reductions stay on the
device and cross to the host once when the block exits. The rows wait on the context
until ``remote.run_step`` takes them into the step's result, so the client can name the
first module whose output went non-finite, or departed from rank 0 or the reference.

Run the reference model under the same helper with ``run="reference"``: rows of one
rank, run and module line up by call order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from workbench.rank import probe_cpu
from workbench.rank.columns import TRACE_COLUMNS  # noqa: F401  (re-exported: the row vocabulary)
from workbench.rank.fingerprint import _fingerprint, fingerprint_host
from workbench.rank.probe import _local

_ATTR = "_trace_rows"
# Prefixes wrappers put in front of the wrapped module's own names.
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
_MAX_TENSORS = 8  # tensors looked at per output (a tuple of cos/sin, a ModelOutput, ...)


def module_name(name: str) -> str:
    """A module path without wrapper prefixes; the root is ``(root)``."""
    return ".".join(p for p in name.split(".") if p and p not in _WRAPPER_PARTS) or "(root)"


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if len(out) >= _MAX_TENSORS:
        return out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):  # also transformers' ModelOutput
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


def _nonfinite(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        host = _nonfinite_host(ts)
        if host is not None:
            return host
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in ts:
        t = _local(t)
        if t.is_floating_point() and not t.is_meta and t.numel():
            total = total + (~torch.isfinite(t)).sum().to(device, torch.float64)
    return total


def _out_stats(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[nan, inf, absmax, meanabs, fp_hi, fp_lo] over the output tensors, on the device."""
    if device.type == "cpu":
        host = _out_stats_host(ts)
        if host is not None:
            return host
    f64 = {"dtype": torch.float64, "device": device}
    nan, inf, count, abs_sum = (torch.zeros((), **f64) for _ in range(4))
    absmax = torch.full((), -math.inf, **f64)
    fp = torch.zeros((), dtype=torch.int64, device=device)
    for i, t in enumerate(ts):
        t = _local(t)
        if t.is_meta or not t.numel() or t.is_complex():
            continue
        flat = t.detach().reshape(-1)
        x = flat.float() if flat.dtype != torch.float64 else flat
        finite = torch.isfinite(x)
        n_nan = torch.isnan(x).sum()
        n_finite = finite.sum()
        ax = x.abs().masked_fill_(~finite, 0.0)
        nan = nan + n_nan.to(device)
        inf = inf + (flat.numel() - n_finite - n_nan).to(device)
        absmax = torch.maximum(absmax, ax.max().to(**f64))
        abs_sum = abs_sum + ax.sum(dtype=torch.float64).to(device)
        count = count + n_finite.to(device)
        fp = fp ^ (_fingerprint(flat).to(device) * (2 * i + 1))
    some = count > 0
    meanabs = torch.where(some, abs_sum / count.clamp(min=1), math.nan)
    absmax = torch.where(some, absmax, math.nan)
    return torch.stack([nan, inf, absmax, meanabs,
                        ((fp >> 32) & 0xFFFFFFFF).to(torch.float64), (fp & 0xFFFFFFFF).to(torch.float64)])


# -- on CPU: the same values by numpy, a few calls a tensor instead of twenty torch ops (a hook runs per module
# call; on the headline model the torch path tripled a forward's time) ----------------------------------------
_U64 = (1 << 64) - 1


def _host_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` (a readable local tensor) flattened, when the host path reads it as the torch path does (what the
    CPU probe batches: whole words, aligned, up to a batch in size); None sends the call there."""
    return t.detach().reshape(-1) if probe_cpu.batchable(t) else None


def _as_float(flat: torch.Tensor) -> np.ndarray:
    """Through ``probe_cpu.host``: ``Tensor.numpy()`` would mark the job's storage not resizable (FSDP2 frees by
    resizing)."""
    return probe_cpu.host(flat if flat.dtype in (torch.float32, torch.float64) else flat.float())


def _nonfinite_host(ts: list[torch.Tensor]) -> torch.Tensor | None:
    total = 0.0
    for t in map(_local, ts):
        if not t.is_floating_point() or t.is_meta or not t.numel():
            continue
        flat = _host_view(t)
        if flat is None:
            return None
        total += flat.numel() - int(np.count_nonzero(np.isfinite(_as_float(flat))))
    return torch.tensor(total, dtype=torch.float64)


def _out_stats_host(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """``_out_stats`` by numpy, bit for bit: counts are exact, absmax is order-free, the |x| sum is the same
    torch sum, the fingerprint the same function (``fingerprint_host``)."""
    nan = inf = count = abs_sum = 0.0
    absmax, fp = -math.inf, 0
    for i, t in enumerate(map(_local, ts)):
        if t.is_meta or not t.numel() or t.is_complex():
            continue
        flat = _host_view(t)
        if flat is None:
            return None
        x = _as_float(flat)
        finite = np.isfinite(x)
        n_finite = int(np.count_nonzero(finite))
        ax = np.abs(x)
        n_nan = 0
        if n_finite < x.size:
            n_nan = int(np.count_nonzero(np.isnan(x)))
            ax[~finite] = 0.0
        nan += n_nan
        inf += x.size - n_finite - n_nan
        absmax = max(absmax, float(ax.max()))
        abs_sum += float(torch.from_numpy(ax).sum(dtype=torch.float64))
        count += n_finite
        fp ^= fingerprint_host(probe_cpu.host(flat, np.uint32)) * (2 * i + 1) & _U64
    some = count > 0
    return torch.tensor([nan, inf, absmax if some else math.nan, abs_sum / max(count, 1.0) if some else math.nan,
                         float((fp >> 32) & 0xFFFFFFFF), float(fp & 0xFFFFFFFF)], dtype=torch.float64)


@contextlib.contextmanager
def _outside_modes() -> Iterator[None]:
    """The hook's own ops are not the step's: the poison's torch-function mode and the ledger's dispatch mode would
    each see every one of them (a third of a traced forward's time on a CPU rank). Plain tensors only run inside
    (``_local`` takes a DTensor's shard by attribute, no op)."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        yield


@contextlib.contextmanager
def trace_forward(ctx: Any, model: nn.Module, run: str = "model", modules: list[str] | None = None) -> Iterator[None]:
    """Record one row per module call of ``model`` while the block runs; rows go on ``ctx``.

    ``run`` labels the rows (``"model"``, ``"reference"``); ``modules``, if given, keeps
    only modules whose cleaned name starts with one of these prefixes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace_forward needs an nn.Module, got {type(model).__name__}")
    rank = getattr(ctx, "rank", 0)
    pending: list[tuple[dict[str, Any], torch.Tensor]] = []
    handles = []

    def hook(name: str):
        def record(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if torch.compiler.is_compiling():
                return  # dynamo traces the hook into the module's graph: fake tensors hold no values to read
            with _outside_modes(), torch.no_grad():
                outs = _tensors(output, [])
                first = next((_local(t) for t in outs), None)
                device = first.device if first is not None else torch.device("cpu")
                ins = _tensors(args, []) + _tensors(kwargs, [])
                stats = torch.cat([_nonfinite(ins, device).reshape(1), _out_stats(outs, device)])
                row = {
                    "rank": rank, "run": run, "call": len(pending), "module": name, "type": type(mod).__name__,
                    "dtype": str(first.dtype).replace("torch.", "") if first is not None else "",
                    "shape": "x".join(map(str, first.shape)) or "()" if first is not None else "",
                    "numel": int(sum(_local(t).numel() for t in outs)),
                    "device": first.device.type if first is not None else "",
                }
            pending.append((row, stats))
        return record

    seen: set[int] = set()
    for raw_name, mod in model.named_modules():
        name = module_name(raw_name)
        if id(mod) in seen or (modules is not None and not any(name.startswith(p) for p in modules)):
            continue
        seen.add(id(mod))
        handles.append(mod.register_forward_hook(hook(name), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        with _outside_modes():
            rows = _finish(pending)
        setattr(ctx, _ATTR, (getattr(ctx, _ATTR, None) or []) + rows)


def _finish(pending: list[tuple[dict[str, Any], torch.Tensor]]) -> list[dict[str, Any]]:
    """One host transfer for every call's statistics."""
    if not pending:
        return []
    stats = [s for _, s in pending]
    if len({s.device for s in stats}) > 1:
        stats = [s.cpu() for s in stats]
    host = torch.stack(stats).cpu().tolist()
    rows = []
    for (row, _), s in zip(pending, host):
        row.update(in_nonfinite=int(s[0]), nan=int(s[1]), inf=int(s[2]), absmax=s[3], meanabs=s[4],
                   fingerprint=f"{int(s[5]):08x}{int(s[6]):08x}")
        rows.append(row)
    return rows


def take(ctx: Any) -> list[dict[str, Any]]:
    """The rows recorded on ``ctx`` since the last call, and forget them."""
    rows = getattr(ctx, _ATTR, None) or []
    setattr(ctx, _ATTR, [])
    return rows
