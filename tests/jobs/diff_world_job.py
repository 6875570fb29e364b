"""An FSDP2 job right at 2 ranks and wrong at 4, with no line of the workbench in it (``workbench job`` captures it).

Every rank builds a small MLP on meta, shards it with ``fully_shard`` (every dimension divides by 2 and by 4),
materialises it with ``to_empty`` and loads rank 0's weights with ``set_model_state_dict``. The non-persistent
buffer ``scale`` (no state dict carries it) is filled on rank 0 and broadcast over a group the script builds as
``[0, 1]``, "the first two ranks": at 2 ranks that is every rank, at 4 ranks 2 and 3 never get it and hold what
``to_empty`` handed out. ``--fix`` broadcasts over the whole world. The same batch on every rank.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.head = nn.Linear(32, 8)
        self.register_buffer("scale", torch.ones(8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.up(x))) * self.scale


ap = argparse.ArgumentParser()
ap.add_argument("--fix", action="store_true", help="broadcast the buffer over every rank")
args = ap.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
first_two = dist.new_group([0, 1])  # every rank makes the group, as new_group asks

with torch.device("meta"):
    model = MLP()
mesh = init_device_mesh("cpu", (world,))
fully_shard(model.up, mesh=mesh)
fully_shard(model.head, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cpu")

full = {}
if rank == 0:
    torch.manual_seed(0)
    full = {"up.weight": torch.randn(32, 16) * 0.1, "up.bias": torch.randn(32) * 0.1,
            "head.weight": torch.randn(8, 32) * 0.1, "head.bias": torch.randn(8) * 0.1}
set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

with torch.no_grad():
    if rank == 0:
        model.scale.copy_(torch.linspace(0.5, 1.5, 8))
    if args.fix:
        dist.broadcast(model.scale, src=0)
    elif rank < 2:
        dist.broadcast(model.scale, src=0, group=first_two)  # the bug: ranks 2 and up are never sent it
    x = torch.linspace(-1, 1, 64).reshape(4, 16)  # the same batch on every rank
    out = model(x)
print(f"rank {rank}: out sum {out.sum().item():.4f}", flush=True)
dist.destroy_process_group()
