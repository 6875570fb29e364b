"""A user's own MoE job on Megatron-FSDP (the real package, 0.6.1), meta-device init, as its docs show it.

    torchrun --nproc-per-node N scripts/gpu_megatron_fsdp_job.py OUT          # the bug
    FIX=1 torchrun --nproc-per-node N scripts/gpu_megatron_fsdp_job.py OUT    # its fix

It imports nothing of the workbench (``scripts/gpu_megatron_fsdp.sh`` runs it under ``workbench job``); it is
``../shared/reference/megatron_fsdp_user_job.py`` with the fix written in. The bug: the router registers
``expert_bias`` with an explicit device (as Megatron's router does with ``--moe-router-enable-expert-bias``), so it
is a real zero tensor even under the meta context; Megatron-FSDP then materialises every module with
``to_empty(recurse=False)`` and ``reset_parameters()``, which rewrites parameters only: ``expert_bias`` holds
whatever memory it was handed. The fix: the buffer made like the parameters (on meta) and written in
``reset_parameters``, so the materialisation writes it. Rank 0 writes ``OUT/result.json`` (losses, expert_bias).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from torch.distributed.device_mesh import init_device_mesh

FIX = os.environ.get("FIX") == "1"
H, E = 256, 8


class Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(E, H))
        if FIX:
            self.register_buffer("expert_bias", torch.empty(E))  # on meta, as the parameters: reset writes it
        else:
            self.register_buffer("expert_bias", torch.zeros(E, device=torch.cuda.current_device()))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.normal_(self.weight, std=0.02)
        if FIX:
            with torch.no_grad():
                self.expert_bias.zero_()

    def forward(self, x):
        scores = torch.softmax(x @ self.weight.t(), -1)
        return torch.topk(scores + self.expert_bias, 2, -1)


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.ffns = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(E))

    def forward(self, x):
        w, idx = self.router(x)
        y = torch.zeros_like(x)
        for k in range(2):
            for e in range(E):
                m = idx[:, k] == e
                if m.any():
                    y[m] += w[m, k, None] * self.ffns[e](x[m])
        return x + y


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(32, H)
        self.blocks = torch.nn.ModuleList(MoE() for _ in range(2))
        self.out = torch.nn.Linear(H, 32)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def main(out: str) -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net()
    mesh = init_device_mesh("cuda", (world, 1), mesh_dim_names=("dp", "tp"))
    model = fully_shard_model(net, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp", fsdp_unit_modules=[MoE],
                              init_model_with_meta_device=True, device=torch.device("cuda"))
    opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        x = torch.randn(64, 32, generator=g).cuda()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    bias = [b.router.expert_bias.float().cpu().tolist() for b in net.blocks]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"fix": FIX, "losses": losses, "expert_bias": bias}, f)
        print("losses", losses, "expert_bias[0][:4]", bias[0][:4], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
