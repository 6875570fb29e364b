"""Issue 47's GPU proof: a user's FSDP2 job, unmodified, under ``workbench job DIR -- torchrun ...``.

    python scripts/gpu_job_zero_code.py --shape tiny --out /tmp/zc            # CPU dry run: 2 ranks, gloo
    python scripts/gpu_job_zero_code.py --ranks 4 --out $OUT                  # one rank per GPU, NCCL
    bash scripts/gpu_job_zero_code.sh                                        # the device machine (4 GPUs)

The job (``job`` below, run by torchrun; it imports nothing of the workbench) is ``reference/user_job_gpu.py``'s:
a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, GQA 32/8, vocab 128256, tied embeddings, bf16) built on
meta, ``fully_shard`` per layer and root, ``to_empty``, parameters initialised from a seed, the rotary
``inv_freq`` forgotten (the user's bug: a non-persistent buffer ``to_empty`` left unwritten), then AdamW steps
on 2 x 512 random tokens a rank, each step timed (synchronised); rank 0 writes ``steps.json``. ``--shape tiny``
is the same job at a CPU size (hidden 64, 2 layers, vocab 512, 2 x 32 tokens).

The driver runs it ``--repeat`` times each way, one after another: plain torchrun (capture off), then under
``workbench job`` with the defaults (points after ``fully_shard``, ``to_empty``, the first forward and the
first optimizer step; the ledger around calls; poison of ``to_empty``), then with ``--every 1`` (a point
after every step, as the reference's manual job took). It reads each capture with ``workbench report`` and
writes ``<out>/job_zero_code_<N><gpu|cpu>.json`` and ``.txt``: the median step time over steps 2.. of each
mode (min-max over runs), the job's wall time, the automatic points, the report's sentence, and whether it
names ``inv_freq`` never written after ``to_empty``. Exit status 0 only when every run ended rc 0 and every
capture's sentence names ``inv_freq``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                         max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=True, rope_theta=500000.0,
                 max_position_embeddings=128),
}
TOKENS = {"llama-3.2-1b": 512, "tiny": 32}


# -- the user's job: no line of the workbench ------------------------------------------------------------
def job(out: str, shape: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda") if gpu else torch.device("cpu")

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    t0 = time.time()
    cfg = LlamaConfig(**SHAPES[shape])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=dev)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    # (the user forgot model.model.rotary_emb's inv_freq: a non-persistent buffer, never written)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    g = torch.Generator(device="cpu").manual_seed(rank)
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (2, TOKENS[shape]), generator=g).to(dev)
        sync()
        t = time.perf_counter()
        outp = model(ids, labels=ids)
        outp.loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - t)
    loss = outp.loss.detach().float()
    dist.all_reduce(loss)
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "steps.json").write_text(json.dumps({
            "world": world, "step_s": times, "loss": loss.item() / world, "wall_s": time.time() - t0,
            "inv_freq_head": model.model.rotary_emb.inv_freq[:3].float().tolist()}))
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def one(mode: str, i: int, args: argparse.Namespace, out: Path) -> dict:
    tag = f"{mode}_run{i}"
    result = out / tag
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
                __file__, "job", str(result), "--shape", args.shape, "--steps", str(args.steps)]
    cap = out / f"{tag}_capture"
    wrapper = {"off": [], "defaults": [sys.executable, "-m", "workbench.cli", "job", str(cap), "--"],
               "every1": [sys.executable, "-m", "workbench.cli", "job", str(cap), "--every", "1", "--"]}[mode]
    t = time.time()
    run = subprocess.run([*wrapper, *torchrun], capture_output=True, text=True, env=_env(), timeout=args.limit)
    doc: dict = {"mode": mode, "run": i, "rc": run.returncode, "wall_s": round(time.time() - t, 2)}
    (out / f"{tag}.log").write_text(run.stdout + run.stderr)
    steps = result / "steps.json"
    if steps.exists():
        got = json.loads(steps.read_text())
        doc.update(step_ms=[round(s * 1000, 2) for s in got["step_s"]], loss=got["loss"],
                   inv_freq_head=got["inv_freq_head"], job_s=round(got["wall_s"], 2))
        later = got["step_s"][2:] or got["step_s"]
        doc["median_step_ms"] = round(statistics.median(later) * 1000, 2)
    if wrapper:
        report = [sys.executable, "-m", "workbench.cli", "report", str(cap), "-o", str(out / f"{tag}.html")]
        rep = subprocess.run(report, capture_output=True, text=True, env=_env(), timeout=600)
        sentence = next((ln[len("diagnosis: "):] for ln in rep.stdout.splitlines() if ln.startswith("diagnosis: ")),
                        rep.stderr.strip()[-500:])
        points = [json.loads(ln).get("point") for ln in (cap / "rank0" / "points.jsonl").read_text().splitlines()
                  if json.loads(ln).get("kind") == "point"] if (cap / "rank0" / "points.jsonl").exists() else []
        doc.update(sentence=sentence, points=points,
                   names_inv_freq=("`inv_freq`" in sentence and "never written after materialisation at step "
                                   "`to_empty`" in sentence))
    print(json.dumps({k: v for k, v in doc.items() if k != "step_ms"}), flush=True)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role")
    j = sub.add_parser("job")
    j.add_argument("out")
    j.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    j.add_argument("--steps", type=int, default=6)
    ap.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    ap.add_argument("--ranks", type=int, default=None, help="default: every GPU, else 2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", default="off,defaults,every1")
    ap.add_argument("--limit", type=float, default=500.0, help="seconds one run may take")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    args = ap.parse_args()
    if args.role == "job":
        job(args.out, args.shape, args.steps)
        return 0
    import torch

    gpus = torch.cuda.device_count()
    args.ranks = args.ranks or (gpus if gpus else 2)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = [one(mode, i, args, out) for i in range(args.repeat) for mode in args.modes.split(",")]
    summary: dict = {"shape": args.shape, "ranks": args.ranks, "gpus": gpus, "steps": args.steps,
                     "device": torch.cuda.get_device_name(0) if gpus else "cpu", "torch": torch.__version__,
                     "modes": {}, "runs": runs}
    for mode in args.modes.split(","):
        mine = [r for r in runs if r["mode"] == mode]
        med = [r["median_step_ms"] for r in mine if "median_step_ms" in r]
        summary["modes"][mode] = {
            "median_step_ms": statistics.median(med) if med else None, "min_max": [min(med), max(med)] if med else None,
            "wall_s": [r["wall_s"] for r in mine], "rc": [r["rc"] for r in mine],
            "sentence": next((r.get("sentence") for r in mine if r.get("sentence")), None),
            "points": next((r.get("points") for r in mine if r.get("points")), None),
            "names_inv_freq": [r.get("names_inv_freq") for r in mine] if mode != "off" else None}
    ok = all(r["rc"] == 0 for r in runs) and all(r.get("names_inv_freq", True) for r in runs)
    summary["ok"] = ok
    name = f"job_zero_code_{args.ranks}{'gpu' if gpus else 'cpu'}"
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1))
    lines = [f"{summary['device']} x{args.ranks}, {args.shape}, {args.steps} steps, torch {torch.__version__}"]
    for mode, m in summary["modes"].items():
        lines.append(f"{mode:9s} median step {m['median_step_ms']} ms (runs {m['min_max']}), wall {m['wall_s']} s, "
                     f"rc {m['rc']}")
    for mode, m in summary["modes"].items():
        if m["sentence"]:
            lines.append(f"{mode}: points {m['points']}\n  {m['sentence']}")
    (out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
