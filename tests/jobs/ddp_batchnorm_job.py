"""A user's own DDP job with BatchNorm: each rank trains on its own batches, 3 SGD steps, 2 CPU ranks, gloo.

    torchrun --standalone --nproc-per-node 2 tests/jobs/ddp_batchnorm_job.py

No line of the workbench in it, and nothing wrong in it: DDP broadcasts rank 0's buffers at the start of each
forward (``broadcast_buffers=True``, its default), and each rank's forward then updates its own running statistics
from its own batch, so between forwards the ranks' ``running_mean`` and ``running_var`` differ by design.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)  # this rank's own data
    for step in range(3):
        x = torch.randn(32, 8, generator=g) * (1 + rank)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    del model, net, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
