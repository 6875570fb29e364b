"""Is it torch or the workbench? HSDP over a 2 x 2 mesh after the world group is destroyed and formed again.

Run under torchrun with 4 GPUs (NCCL): each round forms the world group (eagerly, ``device_id`` bound, as a
workbench engine does), builds a ("replicate", "shard") mesh, ``fully_shard``s a small model, runs a forward and
backward, reads Flight Recorder, then destroys the group. ``--keep`` keeps every round's model and mesh alive
(a live engine keeps its earlier sessions); without it they are dropped before the next round.

    torchrun --nproc-per-node 4 scripts/hsdp_reform_repro.py --rounds 3 [--keep] [--lazy-after-first]
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def one_round(i: int, rank: int, world: int, device: torch.device, kept: list, bind: bool = True) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    port = int(os.environ["MASTER_PORT"]) + 1 + i
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    kw = {"device_id": device} if bind else {}
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), **kw)
    print(f"[r{rank}] round {i}: group formed (device_id bound: {bind})", flush=True)
    mesh = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    print(f"[r{rank}] round {i}: mesh {mesh.get_coordinate()}", flush=True)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    print(f"[r{rank}] round {i}: sharded", flush=True)
    model.to_empty(device=device)
    for p in model.parameters():
        nn.init.normal_(p.to_local())
    out = model(torch.randn(8, 64, device=device))
    out.sum().backward()
    torch.cuda.synchronize()
    try:
        n = len(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    except Exception as exc:
        n = f"{type(exc).__name__}: {exc}"
    print(f"[r{rank}] round {i}: forward+backward ok, FR json {n}", flush=True)
    if kept is not None:
        kept.append((model, mesh))
    dist.destroy_process_group()
    print(f"[r{rank}] round {i}: destroyed", flush=True)


def main() -> int:
    faulthandler.enable()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--lazy-after-first", action="store_true",
                    help="form the group without device_id after the first round (no eager init, no split)")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    kept: list | None = [] if args.keep else None
    for i in range(args.rounds):
        one_round(i, rank, world, device, kept, bind=not (args.lazy_after_first and i > 0))
    print(f"[r{rank}] all {args.rounds} rounds ok (keep={args.keep})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
