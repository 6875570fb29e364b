"""The DDP tutorial's shape: one script, ``torch.multiprocessing.spawn`` starts two ranks on CPU, each joins the group
with the rank and world size it was handed (no launcher: no ``RANK`` in anyone's environment).

    python tests/jobs/spawn_job.py PORT [--bug] [--side PORT2]

Right as it stands. ``--bug`` plants a per-rank learning rate (rank 1's three times rank 0's), so the DDP replicas
part after the first step. ``--side PORT2``: one more process joins a group of its own, as its rank 0, while the
ranks train (as an inference engine the job starts would: a group of one).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def run(rank: int, world: int, bug: bool, joined, done) -> None:
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
            if joined is not None and step == 0:
                joined.set()
                done.wait(60)  # the side group joins while this rank's capture is open
    dist.destroy_process_group()


def side(port: str, joined, done) -> None:
    joined.wait(60)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    print(f"side group {t.sum().item()}", flush=True)
    done.set()


if __name__ == "__main__":
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
    joined = done = other = None
    if "--side" in sys.argv:
        ctx = mp.get_context("spawn")
        joined, done = ctx.Event(), ctx.Event()
        other = ctx.Process(target=side, args=(sys.argv[sys.argv.index("--side") + 1], joined, done))
        other.start()
    mp.spawn(run, args=(2, "--bug" in sys.argv, joined, done), nprocs=2)
    if other is not None:
        other.join()
