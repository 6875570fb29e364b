"""A small training job that captures itself, with a fault injected on a rank (``tests/test_job_faults.py``).

    python -m torch.distributed.run --nproc-per-node 2 tests/fault_job.py OUT --fault 0=FAULT --fault 1=FAULT

Four steps, each a forward on a scratch ``torch.empty`` batch, the job's own ``all_reduce`` of the loss
and a point; each rank prints its loss per step and ``done`` at the end. The faults, each real:

- ``full-disk``: this rank's shard directory (``OUT/rank<r>``) is a tiny tmpfs the test mounted; before
  step 2 the job fills it (another writer took the space): the capture's next write meets ENOSPC;
- ``unmakeable-path``: ``capture`` is given a path below a regular file;
- ``read-only``: ``--read-only DIR`` is a read-only mount, the capture goes below it;
- ``odd-object``: a point is given a wrapper whose ``named_parameters`` raises;
- ``ledger-bug`` / ``poison-bug``: a bug of the workbench's own in the ledger's (poison's) hook, planted
  after ``capture`` (its ``_start`` / ``track`` raise);
- ``die``: the rank SIGKILLs itself after point ``step1``; the other fails in the next all-reduce (and,
  with ``--attach on-error --own-sigterm``, serves post mortem before it exits).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj


class Unreadable(nn.Module):
    """A wrapper whose parameters cannot be listed outside its own context (as some wrappers do)."""

    def named_parameters(self, *args, **kwargs):
        raise RuntimeError("this wrapper's parameters cannot be listed here")


def fill(directory: str) -> None:
    """Take every free byte of the file system under ``directory`` (another writer filled the disk)."""
    with open(Path(directory) / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def say(line: str) -> None:
    """One write per line: the two ranks share torchrun's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fault", action="append", default=[], help="RANK=FAULT")
    ap.add_argument("--read-only", help="a read-only mount for the read-only rank's capture")
    ap.add_argument("--ledger", default="full")
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--attach", help="the capture's post-mortem attach (on-error, ...)")
    ap.add_argument("--deadline", type=float, default=600.0, help="the post mortem's deadline, seconds")
    ap.add_argument("--own-sigterm", action="store_true", help="the job takes SIGTERM itself (as one that saves a "
                    "checkpoint on preemption would): torchrun's SIGTERM after a rank died does not end it")
    args = ap.parse_args()

    if args.own_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: None)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fault = dict(f.split("=", 1) for f in args.fault).get(str(rank), "none")
    path = Path(args.out)
    if fault == "unmakeable-path":
        blocker = path.parent / f"a-file-{rank}"
        blocker.write_text("not a directory\n")
        path = blocker / "runs"
    elif fault == "read-only":
        path = Path(args.read_only) / "runs"
    ledger = {"full": True, "calls": "calls"}[args.ledger]
    strict = {"strict": True} if args.strict else {}
    # the allocator-wide poison (not the default since issue 46): its hook on every torch.empty is what may fail
    cap = wj.capture(path, ledger=ledger, poison="all", points=[f"step{i}" for i in range(4)], attach=args.attach,
                     attach_deadline=args.deadline, **strict)
    if fault == "ledger-bug":
        from workbench.rank import ledger as ledger_mod

        def broken(*a, **k):
            raise ZeroDivisionError("a bug in the ledger's hook")

        ledger_mod._Recorder._start = broken
    elif fault == "poison-bug":
        from workbench.rank import poison

        def broken_track(*a, **k):
            raise ZeroDivisionError("a bug in the poison's hook")

        poison.track = broken_track

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    for step in range(4):
        if fault == "full-disk" and step == 2:
            fill(str(Path(args.out) / f"rank{rank}"))
        if fault == "die" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.empty(4, 8)  # what poison watches
        x.fill_(1.0 + step)
        loss = model(x).sum()
        dist.all_reduce(loss)
        extra = {"wrapper": Unreadable()} if fault == "odd-object" and step == 1 else {}
        cap.point(f"step{step}", model=model, **extra)
        say(f"rank {rank} step {step} loss {loss.item():.4f}")
    cap.close()
    say(f"rank {rank} done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
