"""A DDP job that resumes from a checkpoint, on gloo: right, every rank loads it before the wrap; ``--bug``, rank 0
alone loads it after the wrap (DDP broadcast rank 0's fresh init at the wrap, so the ranks train different weights
from there, and rank 0 takes a ``load_state_dict`` point that rank 1 never does)."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def main() -> None:
    bug = "--bug" in sys.argv
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(123)
    ckpt = build().state_dict()  # the run before's weights
    torch.manual_seed(rank)
    model = build()
    if not bug:
        model.load_state_dict(ckpt)
    ddp = DDP(model)
    if bug and rank == 0:
        model.load_state_dict(ckpt)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        loss = ddp(torch.ones(4, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
