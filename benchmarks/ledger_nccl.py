"""The collectives ledger on NCCL (2 GPUs, no engines): what each rank's ledger says while it hangs.

    python benchmarks/ledger_nccl.py            # needs 2 GPUs; only torch is imported on the ranks

Three runs, each in fresh spawned ranks, each rank writing ``rank<r>.jsonl``:
 1. eval-loop bug: FSDP2 model, rank 0 has 3 batches, rank 1 has 5, then a loss all-reduce.
    The parent polls the files (the ranks never answer) and prints each rank's first
    unfinished call (NCCL is asynchronous: a rank may have queued more behind it),
    then kills the ranks: no 30-minute watchdog wait.
 2. the fix (has-data flag all-reduced with MIN): both ranks finish with the same loss.
 3. ``_broadcast_coalesced`` with rank 0 holding an extra fp32 tensor pair: the ledger shows
    rank 0's two buckets against rank 1's one (NCCL returns without an error).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _load_ledger():
    """workbench/rank/ledger.py by path: the ranks need torch only, not the client's packages."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workbench", "rank", "ledger.py")
    spec = importlib.util.spec_from_file_location("wb_ledger", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["wb_ledger"] = mod
    spec.loader.exec_module(mod)
    return mod


def worker(rank: int, port: int, directory: str, mode: str) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev, timeout=datetime.timedelta(seconds=600))
    ledger = _load_ledger()
    book = ledger.Ledger(directory, rank, "nccl", 0)
    with ledger.recording(book, mode):
        if mode == "coalesced":
            ts = [torch.ones(32, device=dev) for _ in range(2)] if rank == 0 else []
            ts += [torch.ones(1000, device=dev, dtype=torch.bfloat16) for _ in range(3)]
            if rank == 1:
                ts = [torch.ones(32, device=dev, dtype=torch.bfloat16) for _ in range(2)] + ts
            dist._broadcast_coalesced(dist.group.WORLD, ts, 250 * 1024 * 1024, 0)
            time.sleep(3)
            os._exit(0)
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        batches = [torch.randn(8, 1024, device=dev) for _ in range(3 if rank == 0 else 5)]
        loss = torch.zeros(2, device=dev)
        with torch.no_grad():
            it = iter(batches)
            while True:
                b = next(it, None)
                if mode == "fix":
                    flag = torch.tensor(int(b is not None), device=dev)
                    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                    if flag.item() == 0:
                        break
                elif b is None:
                    break
                loss += torch.stack([model(b).pow(2).mean(), torch.tensor(1.0, device=dev)])
        dist.all_reduce(loss)
        torch.cuda.synchronize()
        print(f"[{mode}] rank {rank} loss {(loss[0] / loss[1]).item():.6f}", flush=True)
    dist.destroy_process_group()


def calls(directory: str) -> dict[int, list[dict]]:
    out: dict[int, dict] = {}
    for r in (0, 1):
        path = os.path.join(directory, f"rank{r}.jsonl")
        recs: dict[tuple, dict] = {}
        if os.path.exists(path):
            for line in open(path):
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                key = (e["group"], e["seq"])
                if e["ev"] == "start":
                    recs[key] = {**e, "state": "started"}
                elif key in recs:
                    recs[key].update(state=e["state"], note=e.get("note"))
        out[r] = list(recs.values())
    return out


def run(mode: str, wait_s: float) -> dict[int, list[dict]]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    d = tempfile.mkdtemp(prefix=f"ledger-nccl-{mode}-")
    t0 = time.perf_counter()
    ctx = mp.spawn(worker, args=(port, d, mode), nprocs=2, join=False)
    end = time.monotonic() + wait_s
    while time.monotonic() < end and any(p.is_alive() for p in ctx.processes):
        time.sleep(0.2)
    hung = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
    book = calls(d)  # read while the ranks may still be stuck
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join()
    print(f"[{mode}] {time.perf_counter() - t0:.1f}s; ranks still running at {wait_s:g}s: {hung or 'none'}")
    for r, cs in book.items():
        last = next((c for c in cs if c["state"] == "started"), cs[-1] if cs else None)  # first unfinished
        print(f"[{mode}] rank {r}: {len(cs)} calls; last: " + (
            f"{last['op']} #{last['seq']} {last['dtypes']} {last['shapes']} {last['state']} {last.get('note') or ''}"
            if last else "none"))
    return book


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    print(torch.__version__, torch.cuda.get_device_name(0), "NCCL", torch.cuda.nccl.version())
    bug = run("bug", 20)
    last = {r: next(c for c in cs if c["state"] == "started") for r, cs in bug.items()}
    assert last[0]["op"] == "all_reduce" and last[1]["op"] == "all_gather_into_tensor", last
    assert last[0]["seq"] == last[1]["seq"]
    run("fix", 60)
    co = run("coalesced", 30)
    print("[coalesced] rank 0 buckets:", [(c["dtypes"], c["numel"], c.get("bucket_tensors")) for c in co[0]])
    print("[coalesced] rank 1 buckets:", [(c["dtypes"], c["numel"], c.get("bucket_tensors")) for c in co[1]])
    assert len(co[0]) == 2 and len(co[1]) == 1 and co[0][0]["dtypes"] == ["float32"]
    print("OK")


if __name__ == "__main__":
    main()
