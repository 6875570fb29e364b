"""A user's small MoE job materialised as Megatron-FSDP 0.6.1 does it, on CPU, no line of the workbench in it.

The model is built under ``torch.device("meta")``; its router registers ``expert_bias`` with an explicit real
device (zeros), as Megatron's router does with ``--moe-router-enable-expert-bias``, so that buffer is real even
inside the meta context. Then every module is materialised one by one: ``m.to_empty(device="cpu",
recurse=False)`` then ``m.reset_parameters()`` where it has one (parameters only), the loop of
``megatron_fsdp/param_and_grad_buffer.py``. ``to_empty`` replaces the real buffer with memory nobody wrote.

    torchrun --nproc-per-node 2 meta_moe_job.py [--fix] [--wrap ddp|fsdp2|none] [--steps N]

``--fix``: the router makes ``expert_bias`` again after ``to_empty`` (in ``reset_parameters``): right.
``--nan-at K``: rank 0's batch of step K holds a NaN (its loss is NaN there); ``--skip-nonfinite``: no optimizer
step after a non-finite loss, as a loss scaler (DeepSpeed's "OVERFLOW! Skipping step") does.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--fix", action="store_true")
ap.add_argument("--wrap", default="ddp", choices=["ddp", "fsdp2", "none"])
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--nan-at", type=int, default=-1, help="rank 0's batch holds a NaN at this step (0-based)")
ap.add_argument("--skip-nonfinite", action="store_true", help="no optimizer step after a non-finite loss")
args = ap.parse_args()
H, E = 16, 4


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, H))
        self.register_buffer("expert_bias", torch.zeros(E, device="cpu"))  # explicit device: real under meta

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        if args.fix:
            self.expert_bias = torch.zeros(E, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(x @ self.weight.t(), -1)
        return torch.topk(scores + self.expert_bias, 2, -1)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.router(x)
        y = torch.zeros_like(x)
        for k in range(2):
            for e in range(E):
                y = y + (idx[:, k] == e).unsqueeze(-1) * w[:, k, None] * self.experts[e](x)
        return x + y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, H)
        self.layers = nn.ModuleList(MoE() for _ in range(2))
        self.out = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def materialise(model: nn.Module) -> None:
    """Megatron-FSDP's loop: each module that holds a meta parameter, on its own, then its own reset_parameters."""
    torch.manual_seed(0)
    for m in model.modules():
        if not any(p.is_meta for p in m.parameters(recurse=False)):
            continue
        m.to_empty(device="cpu", recurse=False)
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


dist.init_process_group("gloo")
rank = dist.get_rank()
with torch.device("meta"):
    net = Net()
materialise(net)
if args.wrap == "ddp":
    model = nn.parallel.DistributedDataParallel(net)
elif args.wrap == "fsdp2":
    from torch.distributed.fsdp import fully_shard

    for layer in net.layers:
        fully_shard(layer)
    model = fully_shard(net)
else:
    model = net
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    batch = torch.randn(16, 8, generator=g)
    if step == args.nan_at and rank == 0:
        batch[0, 0] = float("nan")
    loss = model(batch).pow(2).mean()
    loss.backward()
    if not (args.skip_nonfinite and not torch.isfinite(loss)):  # as a loss scaler skips an overflowing step
        opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
dist.destroy_process_group()
