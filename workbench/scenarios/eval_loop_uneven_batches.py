"""eval-loop-uneven-batches: ranks run out of validation batches at different times.

Incident 003 (prime-rl SFT, FSDP). Under FSDP every forward is a collective: each
sharded unit all-gathers its parameters before it runs. The validation loop iterates a
per-rank loader to exhaustion, and the loader packs variable-length samples into
fixed-length chunks and drops the trailing partial chunk, so ranks that hold different
samples get different batch counts (the incident: 327 batches on rank 0, 338 on rank 1).

The first rank out of the loop reaches the loss all-reduce while the others are still
inside a forward, waiting in an all-gather: neither collective can pair. On NCCL this
hangs until the watchdog fires; on gloo it hangs until the group timeout. The ledger
shows each rank's last call: the all-reduce on one rank, an all-gather of the same
sequence number on the other.

Where the 2 x H200 fixture departs from the report: there rank 0's 8-byte all-reduce
*completed* and only rank 1 hung in its all-gather, while the report's watchdog fired on
rank 0 in ALLREDUCE. NCCL does not check that paired ranks run the same collective: with
this tiny model the all-gather (289 KiB) runs on the same small-message protocol as the
all-reduce, and on a 2-rank ring the all-reduce most likely consumed the all-gather's
first chunk and finished (a reading to confirm, not yet measured). The report's all-
gathers were full decoder-layer shards (hundreds of MB, NCCL's SIMPLE protocol), which
cannot satisfy a small all-reduce, so both sides waited; the headline scenario shows the
same protocol-dependent split (853 KB hangs, 3.4 MB completes silently). To be re-
recorded at a layer size on the SIMPLE protocol when GPUs are lent.

Fix ``allreduce-has-data-min``: before every batch, all ranks all-reduce a "has data"
flag with MIN, so the loop stops on every rank as soon as any rank is out of data; the
forwards, and then the loss reductions, run in lockstep and every rank reports the same
loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.lab.models import QWEN3_SHAPE, qwen3_config
from workbench.scenario import Scenario

if TYPE_CHECKING:
    import torch

# torch and the rank helpers are imported inside the steps, which run on the ranks: the client imports
# this module only for its declaration (tests/test_client_imports.py keeps it that way).

SCENARIO = Scenario(
    name="eval-loop-uneven-batches",
    title="FSDP eval loop: ranks with uneven batch counts deadlock (all-reduce vs all-gather)",
    doc=__doc__,
    params={**QWEN3_SHAPE, "num_hidden_layers": 1, "seq_len": 32, "batch_size": 2, "samples": 30,
            "min_len": 4, "max_len": 28, "seed": 11, "wrapper": "fsdp2"},
    probe=["loss_parts"],
    incident="003_472004f2485d4f96",
)
HAS_DATA_MIN = SCENARIO.fix(
    "allreduce-has-data-min",
    "Before each batch, all-reduce a has-data flag with MIN: every rank stops as soon as "
    "any rank is out of data, so the forwards' all-gathers and the loss all-reduce pair up.",
)


@SCENARIO.step
def build(ctx) -> None:
    """The same seeded tiny Qwen3 on every rank (fp32, CPU or this rank's GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(ctx.params["seed"])
    ctx.model = AutoModelForCausalLM.from_config(qwen3_config(**ctx.params)).to(ctx.device).eval()


@SCENARIO.step
def wrap(ctx) -> None:
    """Shard it: FSDP2 ``fully_shard`` per layer and at the root (or FSDP1 FULL_SHARD, a unit per layer)."""
    if ctx.params["wrapper"] == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        # Each decoder layer its own unit: non-root units reshard after forward, so every forward all-gathers.
        layer = type(ctx.model.model.layers[0])
        ctx.net = FSDP(ctx.model, device_id=ctx.device, sharding_strategy=ShardingStrategy.FULL_SHARD,
                       auto_wrap_policy=ModuleWrapPolicy({layer}))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in ctx.model.model.layers:
            fully_shard(layer, mesh=mesh)
        ctx.net = fully_shard(ctx.model, mesh=mesh)
    ctx.note(f"wrapped with {ctx.params['wrapper']}: every forward all-gathers the parameters")


@SCENARIO.step
def load_data(ctx) -> None:
    """This rank's validation shard, packed into fixed-length chunks (trailing partial dropped)."""
    p = ctx.params
    ctx.batches = packed_batches(p["samples"], p["min_len"], p["max_len"], p["seq_len"], p["batch_size"],
                                 p["vocab_size"], seed=p["seed"] * 1000 + ctx.rank)
    ctx.note(f"{len(ctx.batches)} validation batches on this rank")


@SCENARIO.step
def evaluate(ctx) -> None:
    """Mean loss over this rank's batches, then all-reduce (loss sum, token count)."""
    import torch
    import torch.distributed as dist

    loss_sum = torch.zeros((), device=ctx.device)
    tokens = torch.zeros((), device=ctx.device)
    seen = 0
    with torch.no_grad():
        for batch in batches_in_lockstep(ctx) if ctx.fix == HAS_DATA_MIN else iter(ctx.batches):
            batch = batch.to(ctx.device)
            out = ctx.net(input_ids=batch, labels=batch)
            n = batch[:, 1:].numel()
            loss_sum += out.loss.float() * n
            tokens += n
            seen += 1
    ctx.note(f"evaluated {seen} of {len(ctx.batches)} batches; all-reduce of the loss next")
    ctx.loss_parts = {"local": torch.stack([loss_sum, tokens])}
    total = torch.stack([loss_sum, tokens])
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    ctx.output("loss", total[0] / total[1])


def batches_in_lockstep(ctx):
    """Yield batches while every rank still has one: a MIN all-reduce of a has-data flag."""
    import torch
    import torch.distributed as dist

    it = iter(ctx.batches)
    while True:
        batch = next(it, None)
        has_data = torch.tensor(0 if batch is None else 1, device=ctx.device)
        dist.all_reduce(has_data, op=dist.ReduceOp.MIN)
        if has_data.item() == 0:
            return
        yield batch


def packed_batches(samples: int, min_len: int, max_len: int, seq_len: int, batch_size: int, vocab: int,
                   seed: int) -> list[torch.Tensor]:
    """Variable-length samples concatenated and cut into ``seq_len`` chunks; the last partial is dropped."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (samples,), generator=g)
    stream = torch.randint(1, vocab, (int(lengths.sum()),), generator=g)
    chunks = stream[: len(stream) // seq_len * seq_len].view(-1, seq_len)
    return list(chunks.split(batch_size))
