"""A training job that fails on one rank (or deadlocks), attachable post mortem from a notebook.

    python -m torch.distributed.run --nproc-per-node 2 examples/postmortem_job.py runs/pm
    # in a notebook, once a rank raised (runs/pm/attach.json appears):
    cluster = wb.connect(job="runs/pm"); cluster.post_mortem["line"]; cluster.probe("model"); cluster.resume()

Every rank trains a tiny model for a few steps (a forward, then an all-reduce of the loss). At step 2
rank 1's batch has the wrong width (a data-loader bug): its forward raises while rank 0 already waits
in the step's all-reduce. The capture's ``attach="post-mortem"`` makes every rank attachable then: rank 1
on its main thread (the exception as ``exc``, ``step``'s locals ``batch`` and ``model``), rank 0 from its
watcher thread (the locals of the frame that waits). After ``cluster.resume()`` (or ``--deadline``) rank 1
fails with its original exception and the launcher ends rank 0, as without the workbench.
``--deadlock``: instead, at step 2 rank 1 reduces on a subgroup while rank 0 reduces on the world: the
ledgers prove the deadlock after ``--hang-after`` seconds and every rank attaches from its thread.
``--everywhere``: every rank's batch is bad (every rank raises and serves at its exception); ``--catch``:
the script catches the error, calls ``cap.post_mortem()`` and exits 1 itself (no ``sys.excepthook``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj


def step(model: nn.Module, batch: torch.Tensor, n: int, side: object, deadlock: bool) -> float:
    loss = model(batch).pow(2).mean()
    group = side if deadlock and n == 2 and dist.get_rank() == 1 else None  # rank 1: the wrong group
    dist.all_reduce(loss, group=group)
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="the capture directory")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds every rank stays attachable")
    ap.add_argument("--deadlock", action="store_true", help="a deadlock at step 2 instead of an exception")
    ap.add_argument("--hang-after", type=float, default=60.0, help="seconds a call waits before it counts")
    ap.add_argument("--timeout", type=float, default=600.0, help="the process group's timeout (s)")
    ap.add_argument("--everywhere", action="store_true", help="every rank's batch at step 2 is bad")
    ap.add_argument("--catch", action="store_true", help="catch the error, cap.post_mortem(), sys.exit(1)")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    side = dist.new_group()  # a second group over the same ranks (a data-parallel group, say)
    cap = wj.capture(args.out, attach="post-mortem", attach_deadline=args.deadline, hang_after=args.hang_after)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    cap.point("built", model=model)
    for n in range(4):
        bad = n == 2 and not args.deadlock and (rank == 1 or args.everywhere)  # rank 1's bad batch
        batch = torch.ones(4, 6 if bad else 8) * (n + 1)
        try:
            loss = step(model, batch, n, side, args.deadlock)
        except RuntimeError:
            if not args.catch:
                raise
            traceback.print_exc()
            cap.post_mortem()
            sys.exit(1)
        print(f"rank {rank} step {n} loss {loss:.4f}", flush=True)
    cap.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
