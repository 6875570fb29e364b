"""The exercises' variant steps: what each exercise changes in its incident, run on the ranks.

Rank side, like a catalogue scenario file: torch and the lab (``workbench.lab``: the models, the toy
MoE's traced routing) are imported inside the functions (the client pickles them by reference and never
runs them). Each variant builds on the lab and the catalogue's own steps, and changes one thing the
incident notebook did not show.
"""

from __future__ import annotations

import copy
import os


# -- 01: the meta ranks cast to fp16, not bf16 ------------------------------------------------
def cast_fp16(ctx) -> None:
    """Meta ranks: ``model.half()``, a trainer whose mixed-precision dtype is fp16. Rank 0 keeps bf16 + fp32."""
    import torch

    if ctx.rank == 0:
        return
    ctx.model.to(torch.float16)
    ctx.note("model.to(fp16): every parameter and buffer of this rank is now fp16")


# -- 02: rank0-garbage on a model with linear rope scaling --------------------------------------
ROPE_FACTOR = 4.0


def load_scaled_rope(ctx) -> None:
    """Every rank builds on meta from a config with ``rope_type="linear"``; the checkpoint carries it."""
    import torch

    from workbench.lab.models import build_on_meta, qwen3_config, save_checkpoint

    config = qwen3_config(**ctx.params)
    config.rope_parameters = {"rope_type": "linear", "factor": ROPE_FACTOR,
                              "rope_theta": float(ctx.params["rope_theta"])}
    ctx.checkpoint = save_checkpoint(config, os.path.join(ctx.workdir, "ckpt"), ctx.params["seed"])
    ctx.model = build_on_meta(config, torch.bfloat16)
    ctx.note(f"built on meta, rope_type=linear factor {ROPE_FACTOR:g}: inv_freq has no data yet")


# -- 03: two buffers escape the meta context ---------------------------------------------------
def build_scaled_moe(ctx) -> None:
    """Build on meta; ``expert_bias`` (zeros) and ``gate_scale`` (ones) are created on the rank's device."""
    import torch

    from workbench.teach.moe import ScaledMoE

    p = ctx.params
    with torch.device("meta"):
        ctx.model = ScaledMoE(p["vocab_size"], p["hidden"], p["experts"], p["top_k"], ctx.device)
    ctx.note("expert_bias (zeros) and gate_scale (ones) are real; everything else on meta")


def route_scaled(ctx) -> None:
    """Route one batch, traced, next to a reference whose two real buffers hold their creation values."""
    from workbench.lab.toy_moe import route_beside_reference

    reference = copy.deepcopy(ctx.model)
    reference.router.expert_bias.zero_()
    reference.router.gate_scale.fill_(1.0)
    hidden, ref_hidden, load, expected = route_beside_reference(ctx, ctx.model, reference)
    ctx.output("expert_load", load, ref_max_abs_diff=float((load - expected).abs().max()))
    gap = (hidden - ref_hidden).abs().nan_to_num(nan=float("inf")).max().item()
    ctx.output("hidden", hidden, ref_max_abs_diff=gap)
    ctx.note(f"tokens per expert: {load.tolist()} (reference {expected.tolist()}); hidden off by {gap:.3g}")


# -- 07: a third dtype in the bucket ------------------------------------------------------------
def build_three_dtypes(ctx) -> None:
    """Three layers (one dense, two MoE): the first router bias stays fp32, the second was converted to fp16."""
    import torch

    from workbench.lab.weightsync import conversion as cv
    from workbench.scenarios.weight_sync_order_desync import WORKER, build_roles

    build_roles(ctx)
    (first, _), (second, bias) = cv.router_biases(ctx.trainer)[:2]
    bias.data = bias.data.to(torch.float16)
    if ctx.rank == WORKER:  # the worker's copy holds the same dtypes as the trainer's
        worker_bias = dict(ctx.inference.named_buffers())[second]
        worker_bias.data = worker_bias.data.to(torch.float16)
    ctx.note(f"router biases: {first} fp32, {second} fp16; everything else bf16")


# -- 11: the per-rank seed is the global RNG's, set in `build` (for dropout), and the init draws from it -------
def build_seeded_per_rank(ctx) -> None:
    """The tiny Qwen3 on meta; then the global RNG seeded per rank, as data-parallel code does for dropout."""
    import torch

    from workbench.scenarios.hsdp_replicas_diverge_at_init import build

    build(ctx)
    seed = ctx.params["seed"] * 1000 + ctx.rank
    torch.manual_seed(seed)
    ctx.note(f"torch.manual_seed({seed}): this rank's own dropout and data order")


def materialize_global_rng(ctx) -> None:
    """to_empty, the rope buffers, then every local shard from the global RNG (seeded per rank in `build`)."""
    import torch

    from workbench.lab.buffers import recompute_rope
    from workbench.scenarios.hsdp_replicas_diverge_at_init import local_shards

    ctx.model.to_empty(device=ctx.device)
    recompute_rope(ctx.model)
    with torch.no_grad():
        for t in local_shards(ctx.model):
            t.copy_(torch.randn(t.shape) * ctx.params["std"])


def nothing(ctx) -> None:
    """The bug path's slot when the learner's step is added after a step: it does nothing."""
