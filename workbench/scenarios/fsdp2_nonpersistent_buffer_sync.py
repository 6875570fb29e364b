"""fsdp2-nonpersistent-buffer-sync: the FSDP2 state-dict load never carries ``inv_freq``.

Incident 000, its FSDP2 half (SkyRL ``fsdp2_load_full_state_dict``). The model is built on
the meta device, wrapped with ``fully_shard`` per decoder layer and at the root, and
materialised with ``to_empty``. Weights then arrive through
``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``.

That call moves the *state dict*, and non-persistent buffers are not in it: the rotary
embedding's ``inv_freq`` / ``original_inv_freq`` are computed in ``__init__``, which ran
on meta. Two ways the incident goes wrong, one parameter:

- ``variant="rank0-garbage"`` (the default, the incident's own: SkyRL's FSDP2 path calls
  ``_sync_non_persistent_buffers``, whose rank 0 source was itself never initialised; below).
- ``variant="never-synced"``: rank 0 loads ``from_pretrained`` (correct fp32
  ``inv_freq``); the other ranks rely on the state-dict broadcast alone. Their ``inv_freq``
  keeps whatever ``to_empty`` left: NaN under poison, zeros or stale bytes without. Their
  logits are NaN or silently off, and rank 0 looks fine.
- ``variant="rank0-garbage"`` in detail: every rank builds on meta (rank 0 too, with the full state
  dict read from disk), and a ``_sync_non_persistent_buffers`` step broadcasts rank 0's
  buffers afterwards. Rank 0's own ``inv_freq`` came out of ``to_empty`` too, so every
  rank agrees on the same garbage: a cross-rank check sees nothing; only a check against
  the value the config implies (or against a reference forward) does.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from workbench.lab.models import (
    QWEN3_SHAPE,
    build_on_meta,
    load_pretrained,
    qwen3_config,
    save_checkpoint,
    token_batch,
)
from workbench.scenario import Scenario

if TYPE_CHECKING:
    import torch

# torch and the rank helpers are imported inside the steps, which run on the ranks: the client imports
# this module only for its declaration (tests/test_client_imports.py keeps it that way).

VARIANTS = ("never-synced", "rank0-garbage")

SCENARIO = Scenario(
    name="fsdp2-nonpersistent-buffer-sync",
    title="FSDP2 full-state-dict load: non-persistent inv_freq never synced, or synced from garbage",
    doc=__doc__,
    params={**QWEN3_SHAPE, "seq_len": 16, "seed": 0, "variant": "rank0-garbage"},
    probe=["model"],
    incident="000_32cc5898865daad7",
)
INIT_BEFORE_BROADCAST = SCENARIO.fix(
    "init-buffers-before-broadcast",
    "Rank 0 recomputes the rope frequencies in fp32 from the config (the buffer's own init), "
    "then broadcasts its non-persistent buffers after set_model_state_dict. Fixes both variants.",
)
STATE_DICT_THEN_SYNC = SCENARIO.fix(
    "state-dict-then-sync",
    "The upstream order: set_model_state_dict, then broadcast the non-persistent buffers from "
    "rank 0. Fixes never-synced only; on the default rank0-garbage it is what the bug already does "
    "(rank 0's source was never initialised), so the gap stays.",
    non_fix=True,  # on the default variant, the incident's own
)


def meta_rank(ctx) -> bool:
    """Which ranks build on meta: all but rank 0, or every rank in rank0-garbage."""
    return ctx.params["variant"] == "rank0-garbage" or ctx.rank != 0


@SCENARIO.step
def load(ctx) -> None:
    """Rank 0 from_pretrained(dtype=bf16) (never-synced only); meta ranks from_config on meta."""
    import torch

    if ctx.params["variant"] not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}; got {ctx.params['variant']!r}")
    config = qwen3_config(**ctx.params)
    ctx.checkpoint = save_checkpoint(config, os.path.join(ctx.workdir, "ckpt"), ctx.params["seed"])
    if meta_rank(ctx):
        ctx.model = build_on_meta(config, torch.bfloat16)
        ctx.note("built on meta (bf16 weights, fp32 inv_freq): inv_freq has no data yet")
    else:
        ctx.model = load_pretrained(ctx.checkpoint, torch.bfloat16, ctx.device)
        ctx.note("from_pretrained(dtype=bf16): inv_freq computed, fp32")


@SCENARIO.step
def shard(ctx) -> None:
    """fully_shard every decoder layer, then the root, on a 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for layer in ctx.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(ctx.model, mesh=mesh)


@SCENARIO.step
def materialize(ctx) -> None:
    """Meta ranks: to_empty. Parameters, persistent and non-persistent buffers get raw memory."""
    if meta_rank(ctx):
        ctx.model.to_empty(device=ctx.device)
        ctx.note("to_empty: every tensor now real memory, none written")


@SCENARIO.step
def load_state_dict(ctx) -> None:
    """set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True): params + persistent buffers."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full_sd: dict[str, torch.Tensor] = {}
    if ctx.rank == 0:
        from safetensors.torch import load_file

        full_sd = {k: v.to(torch.bfloat16) for k, v in
                   load_file(os.path.join(ctx.checkpoint, "model.safetensors")).items()}
    set_model_state_dict(ctx.model, full_sd,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    names = sorted(n for m in ctx.model.modules() for n in m._non_persistent_buffers_set)
    ctx.note(f"state dict loaded; not in it: {', '.join(dict.fromkeys(names))}")


@SCENARIO.step
def sync_buffers(ctx) -> None:
    """Broadcast non-persistent buffers from rank 0 (rank0-garbage and the fixes); never-synced skips it."""
    variant = ctx.params["variant"]
    from workbench.lab.buffers import recompute_rope, sync_non_persistent_buffers

    if ctx.fix == INIT_BEFORE_BROADCAST and ctx.rank == 0:
        recompute_rope(ctx.model)
        ctx.note("rank 0 recomputed inv_freq in fp32 from the config before the broadcast")
    if variant == "never-synced" and ctx.fix is None:
        ctx.note("no buffer sync: the state-dict broadcast was trusted to carry everything")
        return
    n = sync_non_persistent_buffers(ctx.model, ctx.device)
    ctx.note(f"broadcast {n} non-persistent buffer(s) from rank 0")


@SCENARIO.step
def forward(ctx) -> None:
    """One traced forward on every rank, next to a reference loaded from the same checkpoint."""
    import torch

    from workbench.rank.trace import trace_forward

    ids = token_batch(ctx.params["vocab_size"], ctx.params["seq_len"], ctx.params["seed"], ctx.device)
    reference = load_pretrained(ctx.checkpoint, torch.bfloat16, ctx.device)
    with torch.no_grad():
        with trace_forward(ctx, ctx.model):
            logits = ctx.model(input_ids=ids).logits.float()
        with trace_forward(ctx, reference, run="reference"):
            expected = reference(input_ids=ids).logits.float()
    diff = (logits - expected).abs().nan_to_num(nan=float("inf")).max().item()
    ctx.output("logits", logits, ref_max_abs_diff=diff)
