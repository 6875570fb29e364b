"""An FSDP2 job whose own weight loader is right at 2 ranks and wrong at 4: it slices each full tensor
into ``rows // world_size`` rows a rank, where FSDP2 shards with ``torch.chunk`` (``ceil(rows / world)``).

    python -m torch.distributed.run --nproc-per-node 2 examples/fsdp2_shards_job.py runs/ws2
    python -m torch.distributed.run --nproc-per-node 4 examples/fsdp2_shards_job.py runs/ws4
    workbench diff runs/ws2 runs/ws4

Every rank builds a small MLP on meta, wraps each layer and the root with ``fully_shard``, materialises
it with ``to_empty`` and loads rank 0's full weights (broadcast tensor by tensor) into its shard by hand.
Every dimension divides by 2, so at 2 ranks the slices are FSDP2's shards; the head has 6 rows, which 4
ranks shard 2, 2, 2, 0, while the loader slices 1 row a rank, and ``copy_`` broadcasts that one row over
the shard's two without a word: the head's weights are wrong at 4 ranks only. ``--chunk`` slices as FSDP2
does (``torch.chunk``) and is right at any world size.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import workbench.job as wj


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 6)  # 6 rows: shards evenly over 2 ranks, not over 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.up(x)))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="the capture directory (one shard per rank)")
    ap.add_argument("--chunk", action="store_true", help="slice as FSDP2 shards (torch.chunk): the fix")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    cap = wj.capture(args.out, points=["build", "shard", "materialize", "load_weights", "forward"])
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = MLP()
    cap.point("build", model=model)

    mesh = init_device_mesh("cpu", (world,))
    for layer in (model.up, model.mid, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cap.point("shard", model=model)

    model.to_empty(device="cpu")
    cap.point("materialize", model=model)

    torch.manual_seed(0)
    full = {name: torch.randn(p.shape) * 0.1 for name, p in model.named_parameters()}  # p.shape: the whole shape
    with torch.no_grad():
        for name, p in model.named_parameters():
            dist.broadcast(full[name], src=0)  # rank 0's weights, as a checkpoint loader would send them
            local = p.to_local()
            if args.chunk:
                chunks = torch.chunk(full[name], world)
                piece = chunks[rank] if rank < len(chunks) else None
            else:
                rows = full[name].shape[0] // world  # the bug: assumes every dimension divides by the world size
                piece = full[name][rank * rows:(rank + 1) * rows]
            if piece is not None and local.numel():
                local.copy_(piece)  # broadcasts a short slice over the shard: no error
    cap.point("load_weights", model=model)

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(x)
        loss = out.square().mean()
        dist.all_reduce(loss)
    cap.output("out", out)
    cap.point("forward", model=model)
    cap.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
