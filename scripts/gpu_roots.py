"""Issue 48's NCCL proof that a broadcast whose ranks disagree on the root is reported, not silent.

On NCCL (torch 2.11) such a broadcast returns at once on every rank with no error: each rank is "the root" of
its own call and nothing is sent, so nothing hangs and nothing raises. The workbench must still name it from
the ledgers. Two paths, on 2 GPUs:

1. a live session (``wb.start(ranks=2, backend="nccl")``) whose step broadcasts with ``src=ctx.rank``;
2. a torchrun job with a capture at its top and a point after the same broadcast, read by ``workbench report``.

Writes ``$OUT/roots_nccl.json`` (the sentences and what each path saw) and prints it. Run from the repo root:
    python scripts/gpu_roots.py --out "$OUT"
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import workbench as wb

sc = wb.Scenario("nccl-different-roots", probe=None)
sc.fix("one-root", "every rank names rank 0 as the root")


@sc.step
def roots(ctx):
    import torch
    import torch.distributed as dist

    src = 0 if ctx.fix == "one-root" else ctx.rank  # the bug: each rank its own root
    t = torch.full((4,), float(ctx.rank), device=ctx.device)
    dist.broadcast(t, src=src)
    if t.is_cuda:
        torch.cuda.synchronize()
    ctx.got = {"after": t}


JOB = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import workbench.job as wj
    cap = wj.capture(sys.argv[1])
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:  # a smoke run of this script on CPU (gloo: the bug path hangs until the group's timeout)
        import datetime
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    t = torch.full((4,), float(rank), device=dev)
    dist.broadcast(t, src=rank if sys.argv[2] == "bug" else 0)
    if gpu:
        torch.cuda.synchronize()
    cap.point("after-broadcast", {"t": t})
    print(f"rank {rank} holds {t.tolist()}", flush=True)
    cap.close()
    dist.destroy_process_group()
""")


def live(backend: str) -> dict:
    out: dict = {}
    with wb.start(ranks=2, backend=backend, timeout=30) as cluster:
        for fix in (None, "one-root"):
            s = cluster.session(sc, fix=fix)
            frame = s.step()
            d = s.diagnose()
            errors = {str(k): v for k, v in frame.rank_errors.items()}
            out[fix or "bug"] = {"sentence": d.sentence, "rank_errors": errors,
                                 "released": sorted(frame.released or []),
                                 "devices": {str(k): v for k, v in cluster.devices.items()}}
    return out


def job(tmp: Path) -> dict:
    script = tmp / "roots_job.py"
    script.write_text(JOB)
    out = {}
    for mode in ("bug", "one-root"):
        cap = tmp / f"cap-{mode}"
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                              str(cap), mode], capture_output=True, text=True, timeout=240)
        rep = subprocess.run([sys.executable, "-m", "workbench.cli", "report", str(cap), "-o",
                              str(tmp / f"{mode}.html")], capture_output=True, text=True, timeout=240)
        try:
            sentence = wb.load(cap).bug.diagnose().sentence
        except Exception as exc:  # recorded, the check below reads it
            sentence = f"(the capture did not load: {exc})"
        out[mode] = {"rc": run.returncode, "stdout": run.stdout[-2000:],
                     "stderr": run.stderr[:1500] + " ... " + run.stderr[-500:],
                     "report_rc": rep.returncode, "report_out": (rep.stdout + rep.stderr)[-2000:], "sentence": sentence}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--backend", default="nccl", help="gloo: a smoke run of this script on CPU")
    a = ap.parse_args()
    result = {"live": live(a.backend)}
    with tempfile.TemporaryDirectory() as tmp:
        result["job"] = job(Path(tmp))
    import torch

    result["env"] = {"torch": torch.__version__, "backend": a.backend}
    if torch.cuda.is_available():
        result["env"].update(nccl=".".join(map(str, torch.cuda.nccl.version())), gpu=torch.cuda.get_device_name(0),
                             count=torch.cuda.device_count())
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "roots_nccl.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
