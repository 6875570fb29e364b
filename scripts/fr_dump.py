"""Record real Flight Recorder dumps of a known collective mismatch, one file per rank.

    python scripts/fr_dump.py OUT [--ranks 2] [--backend gloo|nccl] [--format pickle|json|both]

Each rank (a spawned process; gloo on CPU, NCCL on GPU ``rank``) issues:

1. ``all_reduce`` of 4 float32 on every rank (pairs up);
2. ``broadcast`` from rank 0: rank 0 sends 8 float32, the others post 16 bfloat16: the same
   32 bytes, so the call returns on gloo and NCCL and the data is silently reinterpreted
   (the headline incident's shape: a dtype mismatch no timeout will ever report);
3. ``all_reduce`` of 4 float32 on every rank (pairs up);
4. rank 0 only: an ``all_reduce`` of 2 float32 that no other rank joins (async, so the
   rank can still dump): the hang.

then writes its Flight Recorder buffer as ``<prefix><rank>`` (pickle, what
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` dumps contain) and/or ``<prefix><rank>.json``, and
exits without waiting for the open call. ``workbench frtrace OUT`` and ``torchfrtrace
OUT`` read the result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nccl = args.backend == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=args.ranks,
                            **({"device_id": device} if nccl else {}))
    ones = torch.ones(4, device=device)
    dist.all_reduce(ones)
    if rank == 0:
        payload = torch.arange(8, dtype=torch.float32, device=device)
    else:
        payload = torch.zeros(16, dtype=torch.bfloat16, device=device)
    dist.broadcast(payload, src=0)
    dist.all_reduce(ones)
    if nccl:
        torch.cuda.synchronize(device)
    if rank == 0:
        dist.all_reduce(torch.ones(2, device=device), async_op=True)  # nobody joins: stays open
    time.sleep(1.0 if nccl else 0.1)  # let the NCCL watchdog mark the finished calls completed
    out = Path(args.out)
    c10d = torch._C._distributed_c10d
    # torch 2.11 keeps NCCL's buffer apart (_dump_nccl_trace*); _dump_fr_trace* there holds only gloo's
    dump = getattr(c10d, "_dump_nccl_trace", None) if nccl else None
    dump_json = getattr(c10d, "_dump_nccl_trace_json", None) if nccl else None
    if args.format in ("pickle", "both"):
        sub = out / "pickle" if args.format == "both" else out
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{args.prefix}{rank}").write_bytes((dump or c10d._dump_fr_trace)(True, True, False))
    if args.format in ("json", "both"):
        sub = out / "json" if args.format == "both" else out
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{args.prefix}{rank}.json").write_bytes((dump_json or c10d._dump_fr_trace_json)(True, False))
    # Exit only once every rank has dumped: a peer that leaves early makes gloo fail rank 0's open call,
    # and gloo's Flight Recorder then files it as retired and completed like any finished call.
    store = dist.distributed_c10d._get_default_store()
    store.add("fr_dumped", 1)
    try:
        while store.add("fr_dumped", 0) < args.ranks:
            time.sleep(0.05)
    except Exception:
        pass  # the store's host (rank 0) left: everyone has dumped
    sys.stdout.flush()
    os._exit(0)  # rank 0 still has the open all_reduce: do not wait for it


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for the dumps")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--format", default="pickle", choices=["pickle", "json", "both"],
                   help="both: OUT/pickle and OUT/json")
    p.add_argument("--prefix", default="nccl_trace_rank_", help="file name before the rank (torch's default)")
    p.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error("--ranks must be at least 2")
    if args.backend == "nccl" and torch.cuda.device_count() < args.ranks:
        p.error(f"--backend nccl needs {args.ranks} GPUs, this machine has {torch.cuda.device_count()}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # Flight Recorder records NCCL only with a buffer; timing gives started/completed times.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    port = args.port or _free_port()
    t0 = time.perf_counter()
    # gloo on CPU can fork (the ranks start with torch imported: seconds faster); CUDA needs spawn
    method = "spawn" if args.backend == "nccl" or sys.platform != "linux" else "fork"
    mp.start_processes(rank_main, args=(args, port), nprocs=args.ranks, start_method=method)
    files = sorted(str(f.relative_to(args.out)) for f in Path(args.out).rglob("*") if f.is_file())
    print(f"{args.ranks} {args.backend} ranks: {len(files)} dumps in {args.out} ({time.perf_counter() - t0:.1f}s): "
          + ", ".join(files))
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
