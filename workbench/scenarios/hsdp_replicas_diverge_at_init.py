"""hsdp-replicas-diverge-at-init: HSDP replicas of one shard start from different weights.

FSDP2 ``fully_shard`` over a 2-D mesh ``("replicate", "shard")`` is HSDP: the parameters are
sharded along ``shard`` and every shard is held once per ``replicate`` coordinate. The replicas of a
shard must hold the same bytes; nothing in FSDP2 checks that they do. The model is built on meta and
materialised with ``to_empty``, then each rank fills its local shards itself, from a generator
seeded with its *global* rank (a per-rank seed is the habit of data-parallel code, where it seeds
dropout and the data order). Shard ``s`` of replica 0 is then drawn from seed ``s`` and the same
shard of replica 1 from seed ``s + shards``: the replicas disagree from the first step, and nothing
fails. HSDP's gradient all-reduce along ``replicate`` averages their updates, never their weights,
so they stay apart for the whole run (PyTorch #108331 is the same class: HSDP replicas starting from
different points; Megatron hashes parameters across its data-parallel replicas for this reason).

Every rank feeds the forward the same tokens, so the logits must agree too; the replicas' differ.
Each rank also runs the model the seeds intend (one seed per shard coordinate, the whole model on
this rank) as the forward's reference: replica 0 matches it, the other replicas do not.

The mesh is ``(replicas, N / replicas)``: on 4 ranks 2 x 2, on 2 ranks 2 x 1 (two replicas of one
shard). Two fixes:

- ``seed-per-shard``: seed each shard's generator with its coordinate along ``shard``
  (``mesh.get_local_rank("shard")``), so every replica of it draws the same bytes;
- ``broadcast-along-replicate``: keep the per-rank fill, then broadcast every local shard from
  replica 0 along the ``replicate`` dim's group (what ``sync_module_states`` does for FSDP1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.lab.models import QWEN3_SHAPE, build_on_meta, qwen3_config, token_batch
from workbench.scenario import Scenario

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch and the rank helpers are imported inside the steps, which run on the ranks: the client imports
# this module only for its declaration (tests/test_client_imports.py keeps it that way).

MESH_DIMS = ("replicate", "shard")

SCENARIO = Scenario(
    name="hsdp-replicas-diverge-at-init",
    title="HSDP: each rank seeds its shard's init from its global rank, so the replicas of a shard differ",
    doc=__doc__,
    params={**QWEN3_SHAPE, "seq_len": 16, "seed": 0, "replicas": 2, "std": 0.02},
    probe=["model"],
    incident="pytorch#108331",
)
SCENARIO.mesh("N = replicas x shards, replicas >= 2 (on 4 ranks 2 x 2, on 2 ranks 2 x 1)",
              lambda n, p: p["replicas"] >= 2 and n % p["replicas"] == 0)
SEED_PER_SHARD = SCENARIO.fix(
    "seed-per-shard",
    "Seed each shard's generator with its coordinate along the `shard` mesh dim: every replica of a shard "
    "draws the same bytes.",
)
BROADCAST = SCENARIO.fix(
    "broadcast-along-replicate",
    "Keep the per-rank fill, then broadcast every local shard from replica 0 along the `replicate` dim's group.",
)


def shard_seed(ctx, shard: int) -> int:
    """The seed the init means for shard ``shard``: one per shard coordinate."""
    return ctx.params["seed"] * 1000 + shard


def fill(tensors: list[torch.Tensor], generator: torch.Generator, std: float) -> None:
    """Each tensor from ``generator`` in turn (drawn on the CPU, so a GPU rank draws the same numbers)."""
    import torch

    with torch.no_grad():
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=generator) * std)


def local_shards(model: nn.Module) -> list[torch.Tensor]:
    """This rank's piece of every parameter, in the model's order."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


@SCENARIO.step
def build(ctx) -> None:
    """The tiny Qwen3 on meta (fp32): shapes, no memory."""
    import torch

    ctx.model = build_on_meta(qwen3_config(**ctx.params), torch.float32)


@SCENARIO.step
def shard(ctx) -> None:
    """fully_shard every decoder layer and the root over a 2-D mesh ("replicate", "shard"): HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reps = ctx.params["replicas"]
    ctx.mesh = init_device_mesh(ctx.device.type, (reps, ctx.world_size // reps), mesh_dim_names=MESH_DIMS)
    for layer in ctx.model.model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    fully_shard(ctx.model, mesh=ctx.mesh)
    coord = ", ".join(f"{d} {c}" for d, c in zip(MESH_DIMS, ctx.mesh.get_coordinate()))
    ctx.note(f"mesh {reps} x {ctx.world_size // reps} {MESH_DIMS}: this rank is {coord}")


@SCENARIO.step
def materialize(ctx) -> None:
    """to_empty, the rope buffers from the config, then each rank fills its local shards from a seed."""
    import torch
    import torch.distributed as dist

    from workbench.lab.buffers import recompute_rope

    ctx.model.to_empty(device=ctx.device)
    recompute_rope(ctx.model)
    shard_coord = ctx.mesh.get_local_rank("shard")
    seed = shard_seed(ctx, shard_coord) if ctx.fix == SEED_PER_SHARD else ctx.params["seed"] * 1000 + ctx.rank
    fill(local_shards(ctx.model), torch.Generator().manual_seed(seed), ctx.params["std"])
    ctx.note(f"filled this rank's shards from seed {seed}"
             + (" (its shard coordinate)" if ctx.fix == SEED_PER_SHARD else " (its global rank)"))
    if ctx.fix == BROADCAST:
        group = ctx.mesh.get_group("replicate")
        src = dist.get_global_rank(group, 0)
        for t in local_shards(ctx.model):
            dist.broadcast(t, src=src, group=group)
        ctx.note(f"broadcast every local shard from rank {src} (replica 0) along `replicate`")


def intended(ctx) -> nn.Module:
    """The whole model the seeds mean, on this rank: shard ``s`` of every parameter drawn from seed ``s``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = qwen3_config(**ctx.params)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model = model.to(ctx.device).eval()
    shards = ctx.world_size // ctx.params["replicas"]
    gens = [torch.Generator().manual_seed(shard_seed(ctx, s)) for s in range(shards)]
    for p in model.parameters():
        for s, piece in enumerate(p.data.chunk(shards, dim=0)):  # FSDP2's Shard(0): torch.chunk's pieces
            fill([piece], gens[s], ctx.params["std"])
    return model


@SCENARIO.step
def forward(ctx) -> None:
    """The same tokens on every rank, beside the intended model: replicas that differ give other logits."""
    import torch

    ids = token_batch(ctx.params["vocab_size"], ctx.params["seq_len"], ctx.params["seed"], ctx.device)
    reference = intended(ctx)
    with torch.no_grad():
        logits = ctx.model(input_ids=ids).logits.float()
        expected = reference(input_ids=ids).logits.float()
    diff = (logits - expected).abs().nan_to_num(nan=float("inf")).max().item()
    ctx.output("logits", logits, ref_max_abs_diff=diff)
