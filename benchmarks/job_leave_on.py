"""A point every step, left on, as a user meets it (issue 62): off, in-code defaults and zero-code, fresh and warm.

    python benchmarks/job_leave_on.py --shape tiny --steps 4 --rounds 2 --out /tmp/leave_on.json    # CPU dry run
    python benchmarks/job_leave_on.py --out fixtures/gpu/job_leave_on_1gpu.json  # one GPU (scripts/gpu_job_leave_on.sh)

The job (``--role job``, run by torchrun, one rank): a Llama-shaped model (``llama-3.2-1b``: hidden 2048, 16 layers,
GQA 32/8, vocab 128256, tied embeddings; ``tiny`` on CPU), unsharded, bf16, built on meta and materialised with
``to_empty`` then initialised from a seed; AdamW steps of ``--batch`` x ``--seq`` tokens. Three ways:
``off`` (no line of the workbench), ``defaults`` (``wj.capture(dir)`` opened at the top, before the build, as a
user writes it; points at ``meta``, after ``to_empty`` and after every step with ``model`` and ``logits``) and
``zero_code`` (the ``off`` script under ``workbench job DIR --every 1 -- torchrun ...``). Each timed iteration is
the job's step plus its point, synchronised; the figure is the median of steps 2 to the last. Then the same again
with each decoder layer ``.compile()``-d (inductor on GPU, aot_eager on CPU), in the same process.

The driver runs the three ways in ``--rounds`` interleaved rounds, each job a fresh process. Round 1 runs with
fresh caches (empty ``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR`` and ``CUDA_CACHE_PATH`` for that process: a
fresh machine's first job; eager only unless ``--fresh-compile``); later rounds share one warm copy of round 1's
``defaults`` caches. It writes ``--out``
(JSON): ``loop_ms`` (warm rounds, eager), ``fresh_loop_ms`` (round 1, eager), ``compiled_loop_ms`` (warm rounds),
each keyed ``off``, ``defaults`` and ``zero_code``; the same ``_vs_off``; ``first_point_ms`` (the in-code job's
first point on real tensors, on the job's thread, fresh and warm), the probe's build (the child's and the
in-process load), and every job's per-step times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=4096),
}
MODES = ("off", "defaults", "zero_code")
CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH")


# -- the job ---------------------------------------------------------------------------------------------------
def job(args) -> None:
    t_start = time.perf_counter()
    cap = None
    if args.writer_lag is not None:  # before the first point makes the writer (in-code and zero-code alike)
        from workbench.job import writer

        writer.LAG_S = args.writer_lag
    if args.mode == "defaults":  # opened at the top, before the build, as a user's script opens it
        import workbench.job as wj

        cap = wj.capture(args.capture)
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    config = LlamaConfig(attn_implementation="sdpa", **SHAPES[args.shape])
    out = {"mode": args.mode, "device": torch.cuda.get_device_name(device) if gpu else "cpu",
           "torch": torch.__version__, "imports_s": time.perf_counter() - t_start}
    out["eager"] = run(args, cap, config, device, "", None)
    if args.compile:
        backend = "inductor" if gpu else "aot_eager"
        out["compiled"] = run(args, cap, config, device, "c_", backend)
        out["compile_backend"] = backend
    if cap is not None:
        cap.close()
    out["probe_build"] = _build_facts()
    out["wall_s"] = time.perf_counter() - t_start
    dist.destroy_process_group()
    Path(args.result).write_text(json.dumps(out))


def run(args, cap, config, device, tag: str, backend: str | None) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def point(name: str, **objects) -> float:
        if cap is None:
            return 0.0
        sync()
        t0 = time.perf_counter()
        cap.point(name, **objects)
        sync()
        return time.perf_counter() - t0

    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    meta_s = point(tag + "meta", model=model)
    model.to_empty(device=device)
    empty_s = point(tag + "to_empty", model=model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for m in model.modules():  # rope's buffers: to_empty leaves them unwritten (written here: a right job)
            if hasattr(m, "inv_freq"):
                inv, _ = m.compute_default_rope_parameters(m.config)
                m.inv_freq.copy_(inv.to(device))
                m.original_inv_freq = m.inv_freq.clone()
    if backend:
        for layer in model.model.layers:
            layer.compile(backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    loop, points, losses = [], [], []
    steps_t0 = time.perf_counter()
    for i in range(args.steps):
        ids = torch.randint(1, config.vocab_size, (args.batch, args.seq), generator=g).to(device)
        sync()
        t0 = time.perf_counter()
        o = model(input_ids=ids, labels=ids)
        o.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        p = point(f"{tag}step{i}", model=model, **_outs(args, o))
        sync()
        loop.append(time.perf_counter() - t0)
        points.append(p)
        losses.append(float(o.loss))
        del o
    window = loop[2:] if len(loop) > 3 else loop[1:]
    paired = (_paired(args, model, opt, config, device, g, point, tag, cap)
              if args.paired and (not backend or args.paired_compiled) else None)
    profile = _profile(args, model, opt, config, device, g, point, tag) if args.profile and not backend else None
    del model, opt
    return {"profile": profile, "paired": paired,
            "loop_ms": 1e3 * statistics.median(window), "loop_ms_mean": 1e3 * statistics.fmean(window),
            "loop_ms_all": [round(1e3 * x, 2) for x in loop], "point_ms_all": [round(1e3 * x, 2) for x in points],
            "meta_point_ms": 1e3 * meta_s, "to_empty_point_ms": 1e3 * empty_s,
            "first_point_ms": 1e3 * (empty_s if cap is not None else 0.0), "losses": losses[:3] + losses[-1:],
            "steps_t0": steps_t0}


def _outs(args, o) -> dict:
    """The step's logits, for the in-code point beside the model (``--no-logits``: none)."""
    return {"logits": o.logits} if args.logits else {}


def abba_on(k: int) -> bool:
    """Whether the ``k``-th block of a paired reading has the point on: on, off, off, on, on, off, ... (ABBA), so a
    drift through the job weighs on both alike."""
    return (k % 2 == 0) == (k // 2 % 2 == 0)


def _paired(args, model, opt, config, device, g, point, tag: str, cap) -> dict | None:
    """A point's whole cost inside one process, free of the between-process noise (a job's median step moved
    59-76 ms between processes of one device call, and three jobs' in-process ratios spread 0.955-1.041):
    ``--paired`` blocks of ``--paired-block`` more steps, points on in one block of each pair and off in the other
    (the in-code job takes them; the zero-code job's hooks have ``every`` set to 1 or 0), in the order on-off,
    off-on, ... so a drift through the job weighs on both alike. Each step is timed with its point and
    synchronised; each block's first step is left out (it carries the switch and the previous block's writer).
    The in-code point is called as a job calls it, right after ``opt.step()`` with no sync first, as the zero-code
    hooks take theirs (until 2026-11-29 it went through ``point``, which synchronises before it: the point's host
    work then could not overlap the step's last kernels; ``--sync-before-point`` keeps that reading).
    ``ratio``: the median step with a point over the median step without, the capture open in both; ``pair_ratio``:
    the median of each pair's own ratio (its on block's median over its off block's), with ``ci95``, a bootstrap
    interval of it over the pairs, so one job can show whether the cost is under a goal (``ci95[1]``) or not."""
    import torch

    from workbench.job import process, writer

    hooks = process.STATE.hooks
    if cap is None and hooks is None:
        return None
    lags, found = _lags(args.paired_lags), writer.LAG_S
    times: dict[bool, list[float]] = {True: [], False: []}
    blocks: list[tuple[bool, float]] = []
    for blk in range(2 * max(1, args.paired // 2)):
        on = abba_on(blk)
        if hooks is not None:
            hooks.every = 1 if on else 0
        if lags[0] is not None:
            writer.LAG_S = lags[blk // 2 % len(lags)]
        mine = []
        for j in range(max(2, args.paired_block)):
            ids = torch.randint(1, config.vocab_size, (args.batch, args.seq), generator=g).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            o = model(input_ids=ids, labels=ids)
            o.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if on and cap is not None:  # as the job calls it: no sync first (``--sync-before-point``: one)
                if args.sync_before_point:
                    point(f"{tag}pair{blk}_{j}", model=model, **_outs(args, o))
                else:
                    cap.point(f"{tag}pair{blk}_{j}", model=model, **_outs(args, o))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if j:
                mine.append(time.perf_counter() - t0)
            del o
        (cap or hooks.cap).flush()  # the block's last point written before the next block's steps, untimed
        times[on] += mine
        blocks.append((on, statistics.median(mine)))
    if hooks is not None:
        hooks.every = 1
    with_pt, without = statistics.median(times[True]), statistics.median(times[False])
    pairs = [(a[1] / b[1]) if a[0] else (b[1] / a[1]) for a, b in zip(blocks[::2], blocks[1::2])]
    out = {"with_point_ms": round(1e3 * with_pt, 2), "without_ms": round(1e3 * without, 2),
           "ratio": round(with_pt / without, 4), "steps_each": len(times[True]), "pairs": len(pairs),
           "pair_ratio": round(statistics.median(pairs), 4), "ci95": _bootstrap_median(pairs)}
    if lags[0] is not None:  # the writer's lag taken in turns, pair by pair, in this one process
        out["by_lag"] = {f"{lag:g}": {"pair_ratio": round(statistics.median(mine), 4), "pairs": len(mine),
                                      "ci95": _bootstrap_median(mine)}
                         for k, lag in enumerate(lags) for mine in [pairs[k::len(lags)]]}
        writer.LAG_S = found
    return out


def _lags(text: str | None) -> list[float | None]:
    """``--paired-lags`` or ``--writer-lags`` ("0,1"): the writer's lags to take in turn; [None]: as it is."""
    return [float(x) for x in text.split(",")] if text else [None]


def _bootstrap_median(xs: list[float], n: int = 4000, seed: int = 0) -> list[float]:
    """The 2.5th and 97.5th percentiles of the median of ``xs`` resampled with replacement ``n`` times."""
    import numpy as np

    a = np.asarray(xs, dtype=np.float64)
    meds = np.median(np.random.default_rng(seed).choice(a, size=(n, a.size)), axis=1)
    return [round(float(q), 4) for q in np.percentile(meds, [2.5, 97.5])]


def _profile(args, model, opt, config, device, g, point, tag: str) -> str:
    """cProfile of ``--profile`` more steps, each with its point, after the timed ones (their time is not among the
    figures): where the host's time goes, the hooks' and the point's among it. The top 30 by cumulative time."""
    import cProfile
    import io
    import pstats

    import torch

    pr = cProfile.Profile()
    for i in range(args.profile):
        ids = torch.randint(1, config.vocab_size, (args.batch, args.seq), generator=g).to(device)
        pr.enable()
        o = model(input_ids=ids, labels=ids)
        o.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        point(f"{tag}prof{i}", model=model, **_outs(args, o))
        float(o.loss)
        pr.disable()
        del o
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(30)
    return out.getvalue()[-6000:]


def _build_facts() -> dict:
    """What the probe's kernel build took in this process: the child's build and the in-process load (``child_t0``
    and each run's ``steps_t0``: ``time.perf_counter`` of this process, when the child started, the steps began)."""
    from workbench.rank import probe_child, probe_fused

    r = dict(probe_fused._WARM.get("result") or {})
    return {"in_process": r, "nvrtc": probe_fused._WARM.get("nvrtc"), "child": probe_child._BUILD.get("result"),
            "child_t0": probe_child._BUILD.get("t0"), "triton": probe_fused._TRITON.get("why")}


# -- the driver ------------------------------------------------------------------------------------------------
def launch(args, mode: str, rnd: int, caches: dict[str, str], work: Path, lag: float | None = None) -> dict:
    tag = f"{mode}-r{rnd}" + ("" if lag is None else f"-lag{lag:g}")
    result = work / f"{tag}.json"
    job_mode = {"zero_code": "off"}.get(mode, mode)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(Path(__file__).resolve()), "--role", "job", "--mode", job_mode,
           "--shape", args.shape, "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
           "--result", str(result), "--capture", str(work / f"cap-{tag}"), "--profile", str(args.profile if rnd else 0),
           "--paired", str(args.paired), "--paired-block", str(args.paired_block)]
    if args.paired_compiled:
        cmd.append("--paired-compiled")
    if lag is not None:
        cmd += ["--writer-lag", str(lag)]
    if args.paired_lags:
        cmd += ["--paired-lags", args.paired_lags]
    if not args.logits:
        cmd.append("--no-logits")
    if args.sync_before_point:
        cmd.append("--sync-before-point")
    if not args.compile or (rnd == 0 and not args.fresh_compile):
        cmd.append("--no-compile")
    if mode == "zero_code":
        cmd = [sys.executable, "-m", "workbench.cli", "job", str(work / f"cap-{tag}"), "--every", "1", "--", *cmd]
    env = {**os.environ, **caches, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout)
    took = time.perf_counter() - t0
    got = json.loads(result.read_text()) if result.exists() else {}
    got.update(rc=p.returncode, process_s=took, round=rnd, fresh=rnd == 0, mode_key=mode, writer_lag=lag)
    if p.returncode or not got.get("eager"):
        got["log"] = (p.stdout[-1500:] + p.stderr[-9000:])  # a chained cause prints above its traceback
    print(f"{tag}: rc {p.returncode} {took:.0f}s eager {_fmt(got, 'eager')} compiled {_fmt(got, 'compiled')} "
          f"build {json.dumps(got.get('probe_build'))[:300]}", flush=True)
    if got.get("log"):
        print(got["log"], flush=True)
    return got


def _fmt(got: dict, part: str) -> str:
    r = got.get(part)
    return f"{r['loop_ms']:.1f} ms (mean {r['loop_ms_mean']:.1f})" if r else "-"


def drive(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="wb-leave-on-"))
    warm = {k: str(work / "warm" / k.lower()) for k in CACHES}
    runs: list[dict] = []
    t0 = time.perf_counter()
    lags = _lags(args.writer_lags)
    for rnd in range(args.rounds):
        ways = [(m, x) for m in MODES if m in args.modes.split(",") for x in (lags if m != "off" else [None])]
        for mode, lag in ways:
            if time.perf_counter() - t0 > args.budget:
                print(f"budget {args.budget}s spent: {mode} round {rnd} not run", flush=True)
                continue
            if rnd == 0:
                caches = {k: str(work / f"fresh-{mode}-{lag}" / k.lower()) for k in CACHES}
                for d in caches.values():
                    os.makedirs(d)
            else:
                caches = warm
            runs.append(launch(args, mode, rnd, caches, work, lag))
            if rnd == 0 and mode == "defaults":  # the warm rounds start from what a first job left behind
                for k in CACHES:
                    shutil.copytree(caches[k], warm[k], dirs_exist_ok=True)
    doc = summarise(args, runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(table(doc), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


def _pooled(runs: list[dict], part: str, fresh: bool) -> dict:
    """Per way: the median over every step of the window, pooled over the rounds chosen."""
    out = {}
    for mode in MODES:
        xs = [x for r in runs if r["mode_key"] == mode and r["fresh"] == fresh and r.get(part)
              for x in r[part]["loop_ms_all"][2:]]
        if xs:
            out[mode] = round(statistics.median(xs), 2)
    return out


def _ratios(ms: dict) -> dict:
    off = ms.get("off")
    return {k: round(v / off, 3) for k, v in ms.items()} if off else {}


def summarise(args, runs: list[dict]) -> dict:
    loop, fresh = _pooled(runs, "eager", False), _pooled(runs, "eager", True)
    comp = _pooled(runs, "compiled", False) or _pooled(runs, "compiled", True)
    first = {("fresh" if r["fresh"] else f"round{r['round'] + 1}"): round(r["eager"]["first_point_ms"], 1)
             for r in runs if r["mode_key"] == "defaults" and r.get("eager")}
    dev = next((r.get("device") for r in runs if r.get("device")), None)
    return {
        "shape": args.shape, "config": SHAPES[args.shape], "device": dev, "gpus": 1,
        "torch": next((r.get("torch") for r in runs if r.get("torch")), None),
        "in_code_logits": args.logits, "sync_before_point": args.sync_before_point,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "rounds": args.rounds,
        "window": f"median of steps 2-{args.steps - 1}, pooled over the rounds",
        "loop_ms": loop, "loop_vs_off": _ratios(loop), "fresh_loop_ms": fresh, "fresh_vs_off": _ratios(fresh),
        "compiled_loop_ms": comp, "compiled_vs_off": _ratios(comp),
        "first_point_ms": first,
        "paired_ratio": {m: sorted(r["eager"]["paired"]["ratio"] for r in runs
                                   if r["mode_key"] == m and (r.get("eager") or {}).get("paired"))
                         for m in MODES[1:]},
        "paired_ci95": _paired_ci95(runs, "eager"),
        "compiled_paired_ci95": _paired_ci95(runs, "compiled"),
        "probe_build": {f"{r['mode_key']}-r{r['round']}": r.get("probe_build") for r in runs},
        "runs": [{k: r.get(k) for k in ("mode_key", "writer_lag", "round", "fresh", "rc", "process_s", "imports_s",
                                        "wall_s", "eager", "compiled", "log")} for r in runs],
    }


def _paired_ci95(runs: list[dict], how: str) -> dict[str, list[dict]]:
    """Each capturing way's jobs' pair ratios with their intervals, for the eager or the compiled model."""
    return {m: [{**{k: r[how]["paired"].get(k) for k in ("pair_ratio", "ci95", "pairs", "by_lag")},
                 "writer_lag": r.get("writer_lag")}
                for r in runs if r["mode_key"] == m and (r.get(how) or {}).get("paired")] for m in MODES[1:]}


def table(doc: dict) -> str:
    lines = [f"leave-on: {doc['shape']} unsharded on {doc['device']}, torch {doc['torch']}, {doc['batch']} x "
             f"{doc['seq']} tokens, {doc['window']}; first point (job's thread) {doc['first_point_ms']}",
             "| way | warm: step + point ms | vs off | fresh | vs off | compiled | vs off |", "| --- " * 7 + "|"]
    for m in MODES:
        cells = []
        for key, rk in (("loop_ms", "loop_vs_off"), ("fresh_loop_ms", "fresh_vs_off"),
                        ("compiled_loop_ms", "compiled_vs_off")):
            v = doc[key].get(m)
            cells += [f"{v:.1f}" if v is not None else "-", f"{doc[rk][m]:.3f}x" if m in doc[rk] else "-"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append(f"in one process, step + point over step (--paired, each job): {doc['paired_ratio']}")
    for key, how in (("paired_ci95", ""), ("compiled_paired_ci95", " (compiled)")):
        for m, jobs in doc.get(key, {}).items():
            if jobs:
                lines.append(f"  {m}{how}: median pair ratio and its 95% interval, each job: " + "; ".join(
                    f"{j['pair_ratio']} [{j['ci95'][0]}, {j['ci95'][1]}] over {j['pairs']} pairs"
                    + ("" if j.get("writer_lag") is None else f" (writer lag {j['writer_lag']:g} s)")
                    + "".join(f"; lag {g} s: {b['pair_ratio']} [{b['ci95'][0]}, {b['ci95'][1]}] over {b['pairs']}"
                              for g, b in (j.get("by_lag") or {}).items()) for j in jobs))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("driver", "job"), default="driver")
    ap.add_argument("--mode", choices=("off", "defaults"), default="off")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--steps", type=int, default=22)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens a sequence (512; 32 for tiny)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--fresh-compile", action="store_true", help="the fresh round compiled too (eager only else)")
    ap.add_argument("--paired", type=int, default=0, help="blocks of more steps, points on in one of each pair")
    ap.add_argument("--paired-block", type=int, default=3, help="steps a --paired block (its first is left out)")
    ap.add_argument("--paired-compiled", action="store_true", help="the --paired blocks for the compiled model too")
    ap.add_argument("--no-logits", dest="logits", action="store_false", help="in-code points of the model alone "
                    "(a zero-code step point's objects), not the model and the step's logits")
    ap.add_argument("--sync-before-point", action="store_true", help="--paired: the in-code point after a device "
                    "sync (as the timed steps take it, or a job that reads its loss first); else as a job calls it")
    ap.add_argument("--modes", default=",".join(MODES), help="the ways run, of " + ",".join(MODES))
    ap.add_argument("--writer-lag", type=float, default=None, help="job: the writer's LAG_S (0: a point's rows "
                    "made as soon as its kernel is done, as before 2026-11-30)")
    ap.add_argument("--paired-lags", default=None, help="--paired: the writer's LAG_S in turns, pair by pair, "
                    "in each job (e.g. 0,1): a pair ratio for each")
    ap.add_argument("--writer-lags", default=None, help="driver: each capturing way once per lag, e.g. 0,1")
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many more steps after the timed ones")
    ap.add_argument("--budget", type=float, default=440.0, help="seconds after which no further job is started")
    ap.add_argument("--job-timeout", type=float, default=240.0)
    ap.add_argument("--out", default="job_leave_on.json")
    ap.add_argument("--result", default=None)
    ap.add_argument("--capture", default=None)
    args = ap.parse_args()
    if args.seq is None:
        args.seq = 32 if args.shape == "tiny" else 512
    if args.role == "job":
        job(args)
    else:
        sys.exit(drive(args))


if __name__ == "__main__":
    main()
