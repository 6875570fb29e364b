"""What PyTorch's Flight Recorder records of a gloo job, and what it costs (issue 46's first reading).

    TORCH_FR_BUFFER_SIZE=2000 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        scripts/fr_gloo_reading.py [--steps 20]

Each rank (CPU, gloo) runs: plain ``dist.all_reduce`` / ``broadcast`` / ``all_gather_into_tensor``; a small MLP under
DDP (wrap, 3 training steps: the reducer's all-reduces come from C++); the same MLP under FSDP2 ``fully_shard``
(3 steps: all-gathers, reduce-scatters). After each part it reads Flight Recorder
(``torch._C._distributed_c10d._dump_fr_trace_json``) and prints per profiling name how many entries there are, with
their seq ids, sizes, dtypes, process group, state and number of frames; then times: a DDP step with the buffer
on against ``TORCH_FR_BUFFER_SIZE=0`` (run it twice to compare), and one dump (json and pickle) at that length.
Rank 0 prints one JSON document.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def read_fr() -> list[dict]:
    """The pickle dump: the json one (``_dump_fr_trace_json``) carries no frames."""
    import pickle

    raw = torch._C._distributed_c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True,
                                                     onlyActive=False)
    return pickle.loads(raw).get("entries", [])


def summarise(entries: list[dict], since: int) -> dict:
    out: dict[str, dict] = collections.OrderedDict()
    for e in entries:
        if e.get("record_id", 0) < since:
            continue
        d = out.setdefault(e.get("profiling_name"), {"n": 0, "seq": [], "sizes": [], "dtypes": set(), "pg": set(),
                                                     "state": set(), "frames": []})
        d["n"] += 1
        d["seq"].append(e.get("collective_seq_id"))
        if len(d["sizes"]) < 3:
            d["sizes"].append(str(e.get("input_sizes")))
        d["dtypes"].update(e.get("input_dtypes") or [])
        d["pg"].add(str(e.get("process_group")))
        d["state"].add(e.get("state"))
        d["frames"].append(len(e.get("frames") or []))
    return {k: {**v, "dtypes": sorted(v["dtypes"]), "pg": sorted(v["pg"]), "state": sorted(v["state"]),
                "seq": v["seq"][:4] + (["..."] if len(v["seq"]) > 4 else []),
                "frames": f"{min(v['frames'])}-{max(v['frames'])}"} for k, v in out.items()}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    doc: dict = {"torch": torch.__version__, "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE")}
    mark = 0

    def part(name: str) -> None:
        nonlocal mark
        entries = read_fr()
        doc[name] = summarise(entries, mark)
        mark = max([e.get("record_id", -1) for e in entries], default=-1) + 1

    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    out = torch.empty(8)
    dist.all_gather_into_tensor(out, t)
    part("plain")
    if doc["plain"]:
        first = read_fr()[0]
        doc["entry_keys"] = sorted(first)
        doc["entry_example"] = {k: first[k] for k in first if k != "frames"} | {"frames": first.get("frames", [])[:3]}
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(mlp())
    part("ddp_wrap")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(32, 256)
    for _ in range(3):
        ddp(x).sum().backward()
        opt.step()
        opt.zero_grad()
    part("ddp_3_steps")
    from torch.distributed.fsdp import fully_shard

    m = mlp()
    for layer in (m[0], m[2]):
        fully_shard(layer)
    fully_shard(m)
    part("fsdp2_wrap")
    opt2 = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(3):
        m(x).sum().backward()
        opt2.step()
        opt2.zero_grad()
    part("fsdp2_3_steps")
    # cost: a DDP step (its forward, backward with the reducer's all-reduce, optimizer), median over steps
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        ddp(x).sum().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    doc["ddp_step_ms_median"] = round(1e3 * statistics.median(times[2:]), 3)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    doc["all_reduce_us_median"] = round(1e6 * statistics.median(times[2:]), 1)
    n = len(read_fr())
    for name, fn in (("json", lambda: torch._C._distributed_c10d._dump_fr_trace_json(True, False)),
                     ("pickle", lambda: torch._C._distributed_c10d._dump_fr_trace(True, True, False)),
                     ("pickle_no_stacks", lambda: torch._C._distributed_c10d._dump_fr_trace(True, False, False))):
        ts, size = [], 0
        for _ in range(5):
            t0 = time.perf_counter()
            size = len(fn())
            ts.append(time.perf_counter() - t0)
        doc[f"dump_{name}"] = {"entries": n, "ms_median": round(1e3 * statistics.median(ts), 3), "bytes": size}
    if rank == 0:
        print(json.dumps(doc, indent=None, default=str).replace('}, "', '},\n "'))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
