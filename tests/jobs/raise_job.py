"""A training job whose rank 1 raises at its third step (a batch of the wrong width) while rank 0 waits in the
step's all-reduce; with manual points after each optimizer step. Every line that names ``cap`` or ``wj`` is the
workbench's: without them it is the same job, what ``workbench job --every 1`` captures unmodified.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj

dist.init_process_group("gloo")
cap = wj.capture(sys.argv[1] if len(sys.argv) > 1 else None)
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(4):
    batch = torch.ones(4, 6 if step == 2 and rank == 1 else 8) * (step + 1)
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    cap.point(f"step{step + 1}", model=model)
    dist.all_reduce(loss.detach())
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
