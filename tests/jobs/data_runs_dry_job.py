"""A training job whose rank 1's data runs dry one step early: it leaves the loop for the final ``dist.barrier()``
while rank 0 issues the step's ``all_reduce`` (an idle rank that skips a collective, as in Megatron-LM's incidents).
No line of the workbench: ``workbench job DIR -- torchrun ...`` captures it unmodified. ``argv``: ``send`` makes
the parting a point-to-point one instead (rank 0 receives the step's loss from rank 1, which is in the barrier).
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
p2p = len(sys.argv) > 1 and sys.argv[1] == "send"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [torch.ones(4, 8) * (i + 1) for i in range(4 if rank == 0 else 3)]  # rank 1's shard is a batch short
for step, batch in enumerate(batches):
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if p2p:  # rank 0 gathers each step's loss from rank 1
        theirs = torch.zeros(())
        dist.recv(theirs, src=1) if rank == 0 else dist.send(loss.detach(), dst=0)
    else:
        dist.all_reduce(loss.detach())
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
dist.barrier()
dist.destroy_process_group()
