"""What a tensor should hold, where that is computable, so 'all ranks agree on garbage' shows.

A cross-rank check is blind when every rank holds the same wrong bytes (the FSDP2
incident's rank 0 broadcast its own never-initialised buffer). Some tensors have a
value computable from first principles: rotary frequencies from the config, biases a
module documents as zero-initialised. Steps can add their own with ``ctx.expect``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_expectations(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """inv_freq / original_inv_freq of default-type rotary embeddings, recomputed in fp32."""
    out: dict[str, torch.Tensor] = {}
    for name, mod in module.named_modules():
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            continue
        compute = getattr(mod, "compute_default_rope_parameters", None)
        config = getattr(mod, "config", None)
        if compute is None or config is None or getattr(mod, "rope_type", "default") != "default":
            continue
        inv_freq, _ = compute(config)
        base = f"{prefix}{name}." if name else prefix
        for buf in ("inv_freq", "original_inv_freq"):
            if isinstance(getattr(mod, buf, None), torch.Tensor):
                out[base + buf] = inv_freq
    return out


_ROPE: dict[tuple, dict[str, torch.Tensor]] = {}  # (plan stamp, key) -> rope_expectations' answer


def expectations(objects: dict[str, Any], extra: dict[str, torch.Tensor],
                 stamp: tuple | None = None) -> dict[str, torch.Tensor]:
    """``stamp``: the probe's plan stamp (``probe.plan_stamp``), the same only while the modules keep their tree:
    the rope's walk and recomputation are then the last point's (a point every step of a job left captured)."""
    out: dict[str, torch.Tensor] = {}
    for key, obj in objects.items():
        if isinstance(obj, nn.Module):
            got = _ROPE.get((stamp, key)) if stamp is not None else None
            if got is None:
                got = rope_expectations(obj, f"{key}.")
                if stamp is not None:
                    if len(_ROPE) > 8:
                        _ROPE.clear()
                    _ROPE[(stamp, key)] = got
            out.update(got)
    out.update(extra)
    return out


def annotate(rows: list[dict[str, Any]], tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Add ``ref_diff``: max |value - expected| after casting the expectation to the row's dtype.

    The cast makes a correct bf16 copy of an fp32 value compare exactly (diff 0.0); NaN in
    the tensor gives ``inf``. Rows without an expectation get ``None``.
    """
    for row in rows:
        row["ref_diff"] = None
        exp, t = expected.get(row["name"]), tensors.get(row["name"])
        if exp is None or t is None or t.is_meta or t.numel() != exp.numel():
            continue
        # The same bytes (the probe's hash of the whole tensor) against the same expectation: the last point's
        # answer, without its kernels and their wait (a job's point every step: ~0.5 ms on an H200 host)
        fp = row.get("fingerprint")
        key = (row["name"], fp, str(t.dtype), t.numel(), t.device) if isinstance(fp, str) and len(fp) == 16 else None
        hit = _DIFFS.get(key) if key is not None else None
        if hit is not None and hit[0] is exp:
            row["ref_diff"] = hit[1]
            continue
        row["ref_diff"] = diff = diff_of(t, exp)
        if key is not None:
            if len(_DIFFS) > 256:
                _DIFFS.clear()
            _DIFFS[key] = (exp, diff)


def diff_of(t: torch.Tensor, exp: torch.Tensor) -> float:
    """max |t - exp| with ``exp`` cast to ``t``'s dtype first, NaN read as inf (on ``t``'s device: a host copy of a
    GPU tensor gives the same value, every step of it exact in fp32)."""
    with torch.no_grad():
        t = t.detach().reshape(-1)
        e = exp.detach().reshape(-1).to(device=t.device, dtype=t.dtype).float()
        return (t.float() - e).abs().nan_to_num(nan=float("inf")).max().item()


_DIFFS: dict[tuple, tuple[torch.Tensor, float]] = {}  # (name, fingerprint, dtype, numel, device) -> (expected, diff)
