"""A right FSDP1 job whose flat parameter does not divide by 4 (no line of the workbench in it): 78 elements, at 2
ranks 39 a rank, at 4 ranks 20 (the last 2 of rank 3 are FSDP1's padding). Every rank initialises from one seed;
the same batch on every rank."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 6)), device_id=torch.device("cpu"))
with torch.no_grad():
    out = model(torch.linspace(-1, 1, 20).reshape(4, 5))
print(f"rank {dist.get_rank()}: out sum {out.sum().item():.4f}", flush=True)
dist.destroy_process_group()
