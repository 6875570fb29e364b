"""Right parallel code under torchrun (gloo, CPU), captured as a user would, each layout also with one real
divergence. ``python -m torch.distributed.run --nproc-per-node N parallel_layouts_job.py OUT MODE [MODE ...]``:
each mode is one capture, into ``OUT/MODE``.

- ``ddp`` / ``ddp-changed``: each rank seeds its own init (DDP's broadcast makes them one), trains on its own
  batches, ``cap.point(f"step{i}", model=net, logits=out, loss=loss)``; ``-changed``: rank 1 changes a
  weight after DDP's broadcast.
- ``ddp-loss-world``: as ``ddp``, the loss declared ``same_on="world"`` (it is per rank: a broken expectation).
- ``ep`` / ``ep-router``: expert parallel with plain tensors: each rank its own experts, the router
  replicated (its gradients all-reduced); ``-router``: rank 1's router seeded apart.
- ``tp``: ``ColwiseParallel`` / ``RowwiseParallel`` linears on a 1-D ``tp`` mesh.
- ``hsdp`` / ``hsdp-seed-per-shard`` / ``hsdp-broadcast`` (4 ranks): FSDP2 over a 2 x 2 ``(replicate, shard)``
  mesh, each rank filling its local shard from a seed of its global rank (the replicas differ); the fixes:
  a seed per shard coordinate, or a broadcast along the ``replicate`` dim.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj


def batch(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * i + rank)  # each rank its own batch
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def ddp(out: Path, mode: str, rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    with wj.capture(out) as cap:
        torch.manual_seed(1234 + rank)  # each rank its own init: DDP broadcasts rank 0's
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model = DDP(net)
        if mode == "ddp-changed" and rank == 1:
            with torch.no_grad():
                net[2].weight.add_(0.5)  # after the broadcast: this rank's replica parts
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(3):
            x, y = batch(i, rank)
            logits = model(x)
            loss = ((logits - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            same = {"loss": "world"} if mode == "ddp-loss-world" else "learned"
            cap.point(f"step{i}", model=model, logits=logits, loss=loss, same_on=same)


class MoE(nn.Module):
    def __init__(self, rank: int, router_seed: int) -> None:
        super().__init__()
        torch.manual_seed(router_seed)
        self.router = nn.Linear(8, 2)
        torch.manual_seed(100 + rank)  # this rank's own experts
        self.experts = nn.ModuleList([nn.Linear(8, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.router(x).softmax(-1)
        return sum(w[:, k:k + 1] * e(x) for k, e in enumerate(self.experts))


def ep(out: Path, mode: str, rank: int) -> None:
    with wj.capture(out) as cap:
        model = MoE(rank, router_seed=7 if mode == "ep-router" and rank == 1 else 0)
        cap.point("build", model=model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(2):
            x, y = batch(i, rank)
            out_ = model(x)
            loss = ((out_ - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.router.parameters():  # the replicated router's gradients; the experts' stay here
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            opt.step()
            cap.point(f"step{i}", model=model, out=out_, loss=loss)


def tp(out: Path, mode: str, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with wj.capture(out) as cap:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        cap.point("parallelize", model=net)
        torch.manual_seed(1)
        y = net(torch.randn(4, 8))
        cap.point("forward", model=net, out=y)


def hsdp(out: Path, mode: str, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with wj.capture(out) as cap:
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        with torch.device("meta"):
            net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        net.to_empty(device="cpu")
        seed = mesh.get_local_rank("shard") if mode == "hsdp-seed-per-shard" else rank
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in net.parameters():
                local = p.to_local()
                local.copy_(torch.randn(local.shape, generator=g) * 0.1)
                if mode == "hsdp-broadcast":
                    group = mesh.get_group("replicate")
                    dist.broadcast(local, src=dist.get_global_rank(group, 0), group=group)
        cap.point("materialize", model=net)
        torch.manual_seed(3)
        logits = net(torch.randn(4, 16))
        cap.point("forward", model=net, logits=logits)


def main() -> None:
    out, modes = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode in modes:
        {"ddp": ddp, "ep": ep, "tp": tp, "hsdp": hsdp}[mode.split("-")[0]](out / mode, mode, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
