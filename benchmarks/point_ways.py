"""The two ways of taking a step point, side by side on the job's thread (issue 62): in-code (``cap.point`` after
``opt.step()``) and zero-code (``workbench job --every 1``: the hooks' point inside ``opt.step()``).

    python benchmarks/point_ways.py                          # CPU: the tiny shape
    python benchmarks/point_ways.py --shape llama-3.2-1b     # one GPU: the leave-on job's shape, bf16

Each way is a fresh one-rank job. After ``--warm`` steps with points, ``--pairs`` pairs of steps, the point on in
one and off in the other (ABBA): each step's forward and backward run and synchronise first, then what is timed is
the host's time of ``opt.step()`` with the point (in-code: ``opt.step()`` then ``cap.point``; zero-code: the hooks'
``every`` set to 1 or 0), no sync after, then the writer's drain apart. ``point_ms``: the median on-step minus the
median off-step, what the point holds the job's thread. The paired leave-on reading has in-code 0.6-3.6% over
zero-code within one call (docs/performance.md, round 5); this says whether the job's thread is where.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from job_leave_on import SHAPES, abba_on  # noqa: E402  the leave-on job's shapes and pair order


def job(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.job import process

    cap = None
    if args.way == "in_code":
        import workbench.job as wj

        cap = wj.capture(tempfile.mkdtemp(prefix="point-ways-"))
    hooks = process.STATE.hooks
    if args.way == "zero_code" and hooks is None:
        raise SystemExit("point_ways: --way zero_code runs under `workbench job`")
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    seq = args.seq if gpu else min(args.seq, 32)
    config = LlamaConfig(attn_implementation="sdpa", **SHAPES[args.shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device, torch.bfloat16 if gpu else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    def one(i: int, on: bool) -> tuple[float, float]:
        ids = torch.randint(1, config.vocab_size, (2, seq), device=device)
        model(input_ids=ids, labels=ids).loss.backward()
        sync()
        if hooks is not None:
            hooks.every = 1 if on else 0
        t0 = time.perf_counter()
        opt.step()
        if on and cap is not None:
            cap.point(f"p{i}", model=model)
        t1 = time.perf_counter()
        (cap or hooks.cap).flush()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        sync()
        return 1e3 * (t1 - t0), 1e3 * (t2 - t1)

    for i in range(args.warm):
        one(i, True)
    times: dict[bool, list[float]] = {True: [], False: []}
    drains: list[float] = []
    for k in range(2 * args.pairs):
        on = abba_on(k)
        host, drain = one(args.warm + k, on)
        times[on].append(host)
        if on:
            drains.append(drain)
    profile = _profile(args, one) if args.profile else None
    if hooks is not None:
        hooks.every = 1
    if cap is not None:
        cap.close()
    on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
    Path(args.result).write_text(json.dumps({
        "way": args.way, "device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
        "pairs": args.pairs, "step_host_on_ms": round(on_ms, 3), "step_host_off_ms": round(off_ms, 3),
        "point_ms": round(on_ms - off_ms, 3), "drain_ms": round(statistics.median(drains), 3),
        "on_ms_all": [round(x, 3) for x in times[True]], "off_ms_all": [round(x, 3) for x in times[False]],
        "profile": profile}))


def _profile(args: argparse.Namespace, one) -> str:
    """cProfile (the job's thread) of ``--profile`` more on-steps: where the point's time on that thread goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for i in range(args.profile):
        prof.enable()
        one(10**6 + i, True)
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(40)
    stats.print_callers("parameters")  # who walks the model each step (a generator: a call per parameter yielded)
    return out.getvalue()[-12000:]


def drive(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="point-ways-"))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    got = []
    for rnd in range(args.rounds):
        for way in ("in_code", "zero_code"):
            result = work / f"{way}-{rnd}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   str(Path(__file__).resolve()), "--role", "job", "--way", way, "--shape", args.shape,
                   "--seq", str(args.seq), "--warm", str(args.warm), "--pairs", str(args.pairs), "--result",
                   str(result), "--profile", str(args.profile)]
            if way == "zero_code":
                cmd = [sys.executable, "-m", "workbench.cli", "job", str(work / f"cap-{rnd}"), "--every", "1", "--",
                       *cmd]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if p.returncode or not result.exists():
                print(f"{way} round {rnd}: rc {p.returncode}\n{p.stdout[-1500:]}{p.stderr[-3000:]}", flush=True)
                return 1
            got.append(json.loads(result.read_text()))
    print(f"{'way':<11}{'device':<22}{'opt.step on ms':>16}{'off ms':>10}{'point ms':>10}{'drain ms':>10}")
    for r in got:
        print(f"{r['way']:<11}{r['device'][:21]:<22}{r['step_host_on_ms']:>16.3f}{r['step_host_off_ms']:>10.3f}"
              f"{r['point_ms']:>10.3f}{r['drain_ms']:>10.3f}")
    for r in got:
        if r.get("profile"):
            print(f"-- {r['way']}: the job's thread over {args.profile} on-steps\n{r['profile'][:5000]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "runs": got}, indent=1))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("driver", "job"), default="driver")
    ap.add_argument("--way", choices=("in_code", "zero_code"), default="in_code")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many more on-steps of each job")
    ap.add_argument("--result")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.role == "job":
        job(args)
    else:
        sys.exit(drive(args))


if __name__ == "__main__":
    main()
