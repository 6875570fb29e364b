"""An evaluation loop that hangs: ranks hold different numbers of batches (prime-rl's SFT eval).

    python -m torch.distributed.run --nproc-per-node 2 examples/uneven_eval_job.py runs/eval
    workbench report runs/eval          # while it hangs, or after it was killed

Each rank evaluates its own shard of the data through an FSDP2 model (every forward all-gathers
the parameters), then all-reduces (loss sum, token count). Rank 0 holds one batch more than rank 1:
rank 1 reaches the all-reduce while rank 0 is in its next forward's all-gather, and neither call can
ever complete. The capture's ledger is on disk before each call runs, so the shards name both calls
while the job hangs (and, with ``--debug-server``, each rank's worker answers
``workbench.job.ask`` with its open calls). ``--balanced`` gives every rank the same batches (the job then ends);
``--bad-batch`` makes rank 1 raise in its second forward while rank 0 waits for it.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import workbench.job as wj


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="the capture directory (one shard per rank)")
    ap.add_argument("--balanced", action="store_true", help="the same number of batches on every rank")
    ap.add_argument("--debug-server", action="store_true", help="also run PyTorch's debug-server worker per rank")
    ap.add_argument("--bad-batch", action="store_true", help="rank 1's second batch has the wrong width: it raises")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    if args.debug_server:
        # The per-rank half of torch.distributed.debug.start_debug_server (a worker server on every rank;
        # its rank-0 HTTP frontend also needs tabulate, aiohttp and Jinja2): the capture's handler answers there.
        import torch.distributed.debug as debug
        from torch._C._distributed_c10d import _WorkerServer

        debug._WORKER_SERVER = _WorkerServer("::", 0)
    cap = wj.capture(args.out, points=["build", "shard", "evaluate"])  # a rank stuck before "evaluate" reads so
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    cap.point("build", model=model)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cap.point("shard", model=model)

    g = torch.Generator().manual_seed(rank)
    n_batches = 2 if args.balanced else 3 - rank  # rank 0: 3 batches, rank 1: 2
    batches = [torch.randn(4, 64, generator=g) for _ in range(n_batches)]
    if args.bad_batch and rank == 1:
        batches[1] = torch.randn(4, 48, generator=g)  # a malformed sample: rank 1's forward raises
    loss_sum, count = torch.zeros(()), torch.zeros(())
    with torch.no_grad():
        for x in batches:
            loss_sum += model(x).pow(2).mean()
            count += 1
    total = torch.stack([loss_sum, count])
    dist.all_reduce(total)
    cap.output("loss", total[0] / total[1])
    cap.point("evaluate", model=model)

    cap.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
