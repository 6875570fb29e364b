"""fsdp1-rotary-meta-init: rank 0 loads fp32 rotary frequencies, the others cast them to bf16.

Incident 000 (SkyRL v0.2.0, FSDP1, dense Qwen3). Rank 0 takes ``from_pretrained``, which
keeps the non-persistent ``rotary_emb.inv_freq`` buffer fp32 whatever ``dtype=`` says.
Every other rank builds the model on the meta device and casts the whole module to bf16,
buffer included. FSDP1 then materialises the meta ranks with ``to_empty(recurse=False)``
and ``sync_module_states=True`` broadcasts rank 0's states.

The broadcast goes through ``_broadcast_coalesced``, which buckets tensors *by dtype*:
rank 0 sends an fp32 bucket (``inv_freq`` and ``original_inv_freq``) and then a bf16
bucket; a bf16 rank posts one bf16 bucket for everything. The two sides pair the wrong
messages. On gloo the bf16 rank receives rank 0's fp32 bytes into its bf16 bucket
(``inv_freq`` reads ``[0.0, 1.0, ...]``: 1.0f = 0x3F800000 seen as two bf16 halves), the
rest of its bucket keeps what ``to_empty`` left, and rank 0 times out in its second send.
On NCCL (2 x H200, NCCL 2.28.9) the wrap returns to the host on every rank, and what
follows depends on the bucket sizes (scripts/nccl_headline_probe.py). With this
scenario's default shape (853,888 B bucket, NCCL's LL protocol) the bf16 rank's
broadcast kernel never completes: its stream stays blocked, so the first host read on
that rank after the wrap (the probe, ``.item()``, copying logits) waits until the
group's timeout; a further broadcast from rank 0 does not release it. With a 4x larger
shape (hidden_size=256, intermediate_size=512, num_attention_heads=4,
num_key_value_heads=2, vocab_size=1000: 3.39 MB, SIMPLE protocol) it completes
silently instead: ``inv_freq`` all zeros, 22 of 27 tensors wrong (shifted by 64
elements), finite logits ~1.5 off the single-GPU reference.

The incident's fixes are both here: its workaround (``fp32-everywhere``, clean) and its
suggested fix (``sync-buffers-after-wrap``: re-initialise the non-persistent buffers on
rank 0 and sync them after the FSDP1 wrap), which this scenario shows to be a non-fix while
the dtypes are split, since the mispairing happens inside the wrap, before the buffer sync.
Where it departs from the report: the report's trigger (sequence parallelism > 1 and
sequence length >= 128 gave NaN at every position) is not a parameter. It decided only
whether the garbage ``to_empty`` recycled overflowed the rope angles; the workbench's
poison makes that memory NaN on every run, so the NaN shows at any length and without
sequence parallelism (``--no-poison`` shows the garbage the allocator really leaves).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from workbench.lab.fsdp_cpu import allow_cpu_sync_module_states
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

SCENARIO = Scenario(
    name="fsdp1-rotary-meta-init",
    title="FSDP1 meta init: rank 0 keeps fp32 inv_freq, the others cast it to bf16",
    doc=__doc__,
    params={**QWEN3_SHAPE, "seq_len": 16, "seed": 0, "sharding": "NO_SHARD"},
    probe=["model"],
    incident="000_32cc5898865daad7",
)


def _positive_even(value: int) -> bool:
    return value > 0 and value % 2 == 0


SCENARIO.require("head_dim", _positive_even, "must be a positive even number (rotary splits each head in halves)")
CAST_PARAMS_ONLY = SCENARIO.fix(
    "cast-params-only",
    "Cast parameters and persistent buffers to bf16, keep non-persistent buffers fp32 "
    "(what from_pretrained does): every rank then buckets the same dtypes.",
)
RECOMPUTE_AFTER_WRAP = SCENARIO.fix(
    "recompute-after-wrap",
    "Recompute inv_freq after wrapping. A tempting non-fix: it repairs inv_freq, but the "
    "mispaired broadcast already corrupted the other tensors.",
    non_fix=True,
)
SYNC_BUFFERS_AFTER_WRAP = SCENARIO.fix(
    "sync-buffers-after-wrap",
    "The incident's suggested fix: rank 0 re-initialises the non-persistent buffers from the config (what "
    "initialize_weights() does for them) and _sync_non_persistent_buffers broadcasts them after the FSDP1 wrap. "
    "A non-fix while the dtypes are split: sync_module_states mispairs its bucketed broadcast before the buffer "
    "sync runs (gloo: rank 0 times out in the wrap; NCCL: inv_freq repaired, the other tensors stay slid).",
    non_fix=True,
)
FP32_EVERYWHERE = SCENARIO.fix(
    "fp32-everywhere",
    "The incident's workaround (--dtypes fp32): rank 0 loads fp32 and no rank casts to bf16, so every rank "
    "buckets one dtype and the broadcast pairs; it costs twice the memory of bf16.",
)

@SCENARIO.step
def load(ctx) -> None:
    """Rank 0: from_pretrained(dtype=bf16). Other ranks: the same config built on meta."""

    config = qwen3_config(**ctx.params)
    ctx.checkpoint = save_checkpoint(config, os.path.join(ctx.workdir, "ckpt"), ctx.params["seed"])
    if ctx.rank == 0:
        ctx.model = load_pretrained(ctx.checkpoint, model_dtype(ctx), ctx.device)
        ctx.note(f"from_pretrained(dtype={model_dtype(ctx)}): inv_freq kept fp32")
    else:
        ctx.model = build_on_meta(config)
        ctx.note("built on meta from the config (fp32)")


@SCENARIO.step
def cast(ctx) -> None:
    """Meta ranks cast to bf16: the whole module (bug) or only what from_pretrained casts."""
    import torch

    if ctx.rank == 0:
        return
    if ctx.fix == FP32_EVERYWHERE:
        ctx.note("no cast: every tensor stays fp32, as on rank 0")
        return
    if ctx.fix == CAST_PARAMS_ONLY:
        cast_params_and_persistent_buffers(ctx.model, torch.bfloat16)
        ctx.note("cast parameters and persistent buffers; non-persistent buffers stay fp32")
    else:
        ctx.model.to(torch.bfloat16)
        ctx.note("model.to(bf16): inv_freq is now bf16 on this rank")


@SCENARIO.step
def wrap_fsdp1(ctx) -> None:
    """FSDP1 with param_init_fn = to_empty(recurse=False) and sync_module_states=True."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    def param_init_fn(module: torch.nn.Module) -> None:
        module.to_empty(device=ctx.device, recurse=False)

    with allow_cpu_sync_module_states(ctx.device.type):
        ctx.wrapped = FSDP(
            ctx.model,
            param_init_fn=param_init_fn,
            sync_module_states=True,
            device_id=ctx.device,
            sharding_strategy=ShardingStrategy[ctx.params["sharding"]],
            use_orig_params=True,
        )
    if ctx.fix == RECOMPUTE_AFTER_WRAP:
        from workbench.lab.buffers import recompute_rope

        recompute_rope(ctx.model)
        ctx.note("recomputed inv_freq in fp32 after the wrap")
    if ctx.fix == SYNC_BUFFERS_AFTER_WRAP:
        from workbench.lab.buffers import recompute_rope, sync_non_persistent_buffers

        if ctx.rank == 0:
            recompute_rope(ctx.model)
        n = sync_non_persistent_buffers(ctx.model, ctx.device)
        ctx.note(f"rank 0 re-initialised the non-persistent buffers; broadcast {n} of them after the wrap")


@SCENARIO.step
def forward(ctx) -> None:
    """One forward on every rank, against a reference loaded from the same checkpoint."""
    import torch

    from workbench.rank.trace import trace_forward

    ids = token_batch(ctx.params["vocab_size"], ctx.params["seq_len"], ctx.params["seed"], ctx.device)
    net = getattr(ctx, "wrapped", None)
    if net is None:
        net = ctx.model
        ctx.note("the wrap failed on this rank: forward through the unwrapped module")
    reference_model = load_pretrained(ctx.checkpoint, model_dtype(ctx), ctx.device)
    with torch.no_grad():
        with trace_forward(ctx, ctx.model):  # hooks on the inner modules: names as in the reference
            logits = net(input_ids=ids).logits.float()
        with trace_forward(ctx, reference_model, run="reference"):
            reference = reference_model(input_ids=ids).logits.float()
    diff = (logits - reference).abs().nan_to_num(nan=float("inf")).max().item()
    ctx.output("logits", logits, ref_max_abs_diff=diff)


def model_dtype(ctx) -> torch.dtype:
    """bf16 as in the incident; fp32 under its workaround."""
    import torch

    return torch.float32 if ctx.fix == FP32_EVERYWHERE else torch.bfloat16


def cast_params_and_persistent_buffers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """What from_pretrained(dtype=...) casts: parameters and persistent buffers, nothing else."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set and b.is_floating_point():
                module._buffers[name] = b.to(dtype)
