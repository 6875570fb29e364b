"""DDP under the capture's defaults (issue 46): 3 steps, a point after each; the reducer's all-reduces come from C++.

Between points the job checks that the capture keeps no mode on torch's dispatch or function stacks (what would slow
every op and keep ``torch.compile`` from compiling) and exits 3 where it does.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj

cap = wj.capture(sys.argv[1], points=["step0", "step1", "step2"])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batch = torch.linspace(-1, 1, 32).reshape(4, 8) * (dist.get_rank() + 1)  # each rank its own batch
for step in range(3):
    modes = torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()
    if modes != (0, 0):
        print(f"rank {dist.get_rank()}: modes on the stacks between points: dispatch {modes[0]}, function {modes[1]}",
              flush=True)
        sys.exit(3)
    loss = model(batch).pow(2).mean()
    loss.backward()  # BACKWARD: the reducer's all-reduce
    opt.step()
    opt.zero_grad()
    cap.point(f"step{step}", model=model)
cap.close()
dist.destroy_process_group()
