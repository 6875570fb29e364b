"""A user's own DeepSpeed script: ZeRO stage 1 or 2, a regression MLP that normalises its inputs by statistics it
keeps in buffers, computed from the training data before training; CPU, gloo.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 tests/jobs/stack_deepspeed_stats.py [--stage 2]
        [--per-rank-stats]

No line of the workbench in it. Right as it stands: each rank holds a shard of the data, so the statistics are
averaged over the ranks before the model is handed to DeepSpeed. ``--per-rank-stats`` plants the bug: the
all-reduce forgotten, each rank keeps its own shard's mean and std. DeepSpeed broadcasts the parameters at
``initialize``, never the buffers, so the ranks normalise differently and their averaged gradients describe no
rank's model. The losses still fall: nothing fails.
"""

import argparse
import logging
import warnings

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from torch import nn

STEPS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("std", torch.ones(8))
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body((x - self.mean) / self.std)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=1, choices=(0, 1, 2))
    ap.add_argument("--per-rank-stats", action="store_true", help="plant the bug: each rank its own statistics")
    ap.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's argument
    args = ap.parse_args()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo: no JIT build of the shm op
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)  # this rank's shard of the data
    x = torch.randn(256, 8, generator=g) * (1 + rank) + rank
    y = x.sum(dim=1, keepdim=True)
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        stats = torch.stack([x.mean(0), x.std(0)])
        if not args.per_rank_stats:
            dist.all_reduce(stats)
            stats /= dist.get_world_size()
        model.mean.copy_(stats[0])
        model.std.copy_(stats[1])
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**6}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for step in range(STEPS):
        i = torch.arange(step * 16, step * 16 + 16)
        loss = nn.functional.mse_loss(engine(x[i]), y[i])
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
