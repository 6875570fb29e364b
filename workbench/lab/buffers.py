"""Non-persistent buffers (rotary ``inv_freq``): what no state dict carries, so init paths must
compute or sync them themselves. Shared by the incident-000 scenarios, FSDP1 and FSDP2 alike."""

from __future__ import annotations

import torch


def recompute_rope(model: torch.nn.Module) -> None:
    """Each rotary embedding's ``inv_freq`` from its config, fp32, as ``__init__`` computes it (and
    ``initialize_weights()`` would): the one source for these buffers that never touched memory."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            inv_freq, _ = module.compute_default_rope_parameters(module.config)
            device = module.inv_freq.device
            module.inv_freq = inv_freq.to(device)
            module.original_inv_freq = inv_freq.clone().to(device)


def sync_non_persistent_buffers(model: torch.nn.Module, device: torch.device) -> int:
    """SkyRL's ``_sync_non_persistent_buffers``: rank 0's copy of each buffer, to every rank.

    Rank 0 sends whatever it holds; nothing checks that it was ever initialised.
    """
    import torch.distributed as dist

    count = 0
    for module in model.modules():
        for key in sorted(module._non_persistent_buffers_set):
            buf = module._buffers.get(key)
            if buf is None:
                continue
            if dist.get_rank() == 0:
                src = buf.detach().to(device).contiguous()
            else:
                src = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            dist.broadcast(src, src=0)
            module._buffers[key] = src
            count += 1
    return count
