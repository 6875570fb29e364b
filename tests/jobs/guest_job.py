"""A 2-rank gloo training job as a new user writes it on their first hour with ``workbench job``.

``raise`` (the default): rank 1 raises ``ValueError("bad batch on rank 1")`` at step 1 while rank 0 waits in the
step's all-reduce. ``deadlock``: at step 1 rank 1 reduces on a second group over the same ranks while rank 0
reduces on the world (a deadlock the ledgers prove once both calls are open past ``--hang-after``). The
script's own capture lines are the workbench's API as a new user meets it: a ``wj.capture`` call with its
own path and options (under ``workbench job``: the job's capture, its path and options replaced, said once),
and an object passed by position (``cap.point("x", model)``: said once, records nothing). Rank 0 prints
``step N`` after each step on stdout.
"""

import datetime
import sys

import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj

mode = sys.argv[1] if len(sys.argv) > 1 else "raise"
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank = dist.get_rank()
side = dist.new_group()  # a second group over the same ranks (a data-parallel group, say)
cap = wj.capture("runs/mine", attach="on-error", hang_after=30.0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
for step in range(3):
    cap.point(f"by-position{step}", model)
    batch = torch.ones(4, 8) * (step + 1)
    if step == 1 and rank == 1 and mode == "raise":
        raise ValueError("bad batch on rank 1")
    loss = model(batch).pow(2).mean()
    group = side if step == 1 and rank == 1 and mode == "deadlock" else None
    dist.all_reduce(loss.detach(), group=group)
    cap.point(f"step{step}", model=model)
    if rank == 0:
        print(f"step {step}", flush=True)
dist.destroy_process_group()
