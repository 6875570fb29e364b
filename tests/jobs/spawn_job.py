"""The DDP tutorial's shape: one script, ``torch.multiprocessing.spawn`` starts two ranks on CPU, each joins the group
with the rank and world size it was handed (no launcher: no ``RANK`` in anyone's environment).

    python tests/jobs/spawn_job.py PORT [--bug]

Right as it stands. ``--bug`` plants a per-rank learning rate (rank 1's three times rank 0's), so the DDP replicas
part after the first step.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def run(rank: int, world: int, bug: bool) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    lr = 0.05 * (3 if bug and rank == 1 else 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    for step in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
    mp.spawn(run, args=(2, "--bug" in sys.argv), nprocs=2)
