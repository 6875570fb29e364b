"""A clean data-parallel job (DDP, the same batch on every rank, SGD), no line of the workbench in it.

``--wait FILE``: after training, rank 0 writes FILE and every rank sleeps until the launcher is signalled.
"""

import argparse
import pathlib
import time

import torch
import torch.distributed as dist
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--wait", default=None)
args = ap.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batch = torch.linspace(-1, 1, 32).reshape(4, 8)
for step in range(3):
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
if args.wait:
    if rank == 0:
        pathlib.Path(args.wait).write_text("ready")
    while True:
        time.sleep(0.1)
dist.destroy_process_group()
