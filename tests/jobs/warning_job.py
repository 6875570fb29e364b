"""A user's own DDP job whose calls into torch warn: 2 CPU ranks, gloo, 2 SGD steps.

    torchrun --standalone --nproc-per-node 2 tests/jobs/warning_job.py

No line of the workbench in it. ``DistributedDataParallel(..., broadcast_buffers=True)`` warns (a FutureWarning in
torch 2.13) with ``stacklevel=2``: Python names the line that called it, this file's. A wrapper of the workbench's
between the two must not take that line's place in the job's stderr.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1), broadcast_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
