"""A job whose optimizer steps bare tensors no module holds (as ZeRO's flat partitions are): the capture's only
point probes them, never a model, so its report must not read "clean". No line of the workbench in it."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
w = torch.nn.Parameter(torch.linspace(-1, 1, 8))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(2):
    loss = (w * w).sum()
    loss.backward()
    dist.all_reduce(w.grad)
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
dist.destroy_process_group()
