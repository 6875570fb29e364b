"""What the capture costs a training job: FSDP2 steps with capture off, with the full ledger, with the
ledger around calls only, and with that and poison of to_empty only, a point at every step; under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/job_capture_cost.py --shape tiny
    torchrun --nproc-per-node 4 scripts/job_capture_cost.py --shape qwen3-1.7b --out fixtures/gpu/job_capture.json

A Qwen3-shaped model (``tiny``: the catalogue's; ``qwen3-1.7b``: 28 layers, hidden 2048, bf16) is built
on meta, ``fully_shard``-ed per layer, materialised with ``to_empty`` and trained with SGD on random
tokens (one GPU per rank under NCCL where there are GPUs, else gloo on CPU). For each mode the same
steps run; the job's own step time (forward, backward, optimizer, synchronised) is timed apart from
the point that follows it. Rank 0 prints and writes (``--out``) the medians: step ms, point ms (first
and after), bytes a point, rows a point.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen3Config

import workbench.job as wj

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from job_capture import build  # the one FSDP2 meta build both scripts measure

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, vocab_size=512, tie_word_embeddings=False),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}
MODES = {"off": dict(enabled=False), "full": dict(), "calls": dict(ledger="calls"),
         "light": dict(ledger="calls", poison="to_empty")}  # no mode on the job between points


def build_model(config: Qwen3Config, device: torch.device, world: int) -> torch.nn.Module:
    """Built on meta, ``fully_shard``-ed per layer and whole, materialised with ``to_empty``, initialised
    (weights N(0, 0.02) from seed 0, rope's ``inv_freq`` recomputed: ``to_empty`` leaves buffers unwritten):
    ``benchmarks/job_capture.py``'s build, uncompiled, so both measure the same job."""
    return build(config, device, world, None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--modes", default="off,full,calls,light")
    ap.add_argument("--out", default=None, help="rank 0 writes the figures here (JSON)")
    ap.add_argument("--runs", default=None, help="the capture directories (default: one in the temp dir, per job)")
    args = ap.parse_args()

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = Qwen3Config(attn_implementation="sdpa", **SHAPES[args.shape])
    runs = args.runs or os.path.join(tempfile.gettempdir(), f"wb-job-cost-{os.environ.get('TORCHELASTIC_RUN_ID')}")
    figures: dict[str, dict] = {}
    for mode in args.modes.split(","):
        cap = wj.capture(os.path.join(runs, mode), **MODES[mode])
        cap.local("loss")  # each rank's own batch: its loss is its own, not a replica of rank 0's
        model = build_model(config, device, world)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(rank)
        step_s, point_s, point_b, rows = [], [], [], []
        for i in range(args.steps):
            ids = torch.randint(1, config.vocab_size, (1, args.seq_len), generator=g).to(device)
            sync(device)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            step_s.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            info = cap.point(f"step{i}", model=model, loss=loss.detach())
            sync(device)
            point_s.append(time.perf_counter() - t1)
            if info:
                point_b.append(info["bytes"])
                rows.append(info["rows"])
        cap.close()
        del model, opt
        after = slice(1, None) if args.steps > 1 else slice(None)
        figures[mode] = {
            "step_ms_median": 1e3 * statistics.median(step_s[after]), "step_ms_first": 1e3 * step_s[0],
            "point_ms_first": 1e3 * point_s[0] if point_b else None,
            "point_ms_median": 1e3 * statistics.median(point_s[after]) if point_b else None,
            "point_bytes_median": statistics.median(point_b) if point_b else None,
            "rows_a_point": rows[0] if rows else None,
        }
        dist.barrier()
    if rank == 0:
        doc = {"shape": args.shape, "runs": runs, "ranks": world, "backend": dist.get_backend(), "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if gpu else "cpu", "steps": args.steps,
               "seq_len": args.seq_len, "torch": torch.__version__, "rank0": figures}
        print(json.dumps(doc, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
