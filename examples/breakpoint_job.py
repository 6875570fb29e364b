"""A job that stops at a breakpoint for a notebook, then goes on with what the notebook changed.

    python -m torch.distributed.run --nproc-per-node 2 examples/breakpoint_job.py runs/bp
    # in a notebook, while the job waits:
    cluster = wb.connect(job="runs/bp"); cluster.probe("model"); ...; cluster.resume()

A tiny model with a buffer (``scale``, 1.0) is built and recorded at a point; at the breakpoint
every rank serves as an engine until a client resumes it (or ``--deadline`` seconds pass); then
each rank computes ``model(x).sum()`` with the buffer as it now is, the ranks all-reduce it, and
rank 0 writes ``<out>/result.json`` (the buffer each rank ended with, the reduced output, how the
breakpoint ended). ``--again``: a second breakpoint right after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="the capture directory")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds the breakpoint waits for a client")
    ap.add_argument("--controller", help="a running ipcontroller's engine file to register with (default: rank 0 "
                    "starts one)")
    ap.add_argument("--again", action="store_true", help="a second breakpoint after the first (attach twice)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cap = wj.capture(args.out)
    torch.manual_seed(0)
    model = Scaled()
    for p in model.parameters():
        nn.init.constant_(p, 0.5)
    cap.point("built", model=model)
    threads = sorted(t.name for t in threading.enumerate())
    # every rank; returns when a client resumes, or at the deadline
    how = cap.breakpoint(deadline=args.deadline, controller=args.controller)
    print(f"rank {rank}: back from the breakpoint ({how['by']}), scale {model.scale.item()}", flush=True)
    again = cap.breakpoint(deadline=args.deadline, first=how["by"]) if args.again else None
    out = model(torch.ones(2, 4)).sum()
    dist.all_reduce(out)
    scales = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(scales, model.scale)
    if rank == 0:
        Path(args.out, "result.json").write_text(json.dumps({
            "scale": [s.item() for s in scales], "out": out.item(), "by": how["by"],
            "seconds": how["seconds"], "attach_s": how.get("attach_s"), "pid": os.getpid(),
            "again": again and again["by"],
            "threads_left": sorted(set(t.name for t in threading.enumerate()) - set(threads))}))
    cap.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
