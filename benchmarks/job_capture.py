"""What the capture costs a training job, mode by mode, eager and compiled (issue 46: capture you leave on).

    python benchmarks/job_capture.py                       # CPU: spawns torchrun (2 ranks, gloo), prints the table
    torchrun --nproc-per-node 4 benchmarks/job_capture.py --shape llama-3.2-1b \\
        --out fixtures/gpu/job_capture_leave_on_4gpu.json   # GPUs: NCCL, one GPU a rank (scripts/job_capture_gpu.sh)

A Llama-shaped model (``tiny`` on CPU; ``llama-3.2-1b``: hidden 2048, 16 layers, GQA 32/8, vocab 128256, tied
embeddings) is built on meta in bf16, ``fully_shard``-ed per layer and whole (FSDP2), materialised with
``to_empty`` and initialised from a seed; then ``--steps`` training steps (AdamW) of ``--batch`` x ``--seq``
tokens a rank, with one point a step: ``cap.point(f"step{i}", model=model, logits=out.logits)``. Per mode the
job's own step (forward, backward, optimizer, synchronised) is timed apart from the point after it; the figure is
the median of steps 2 to the last. Modes: ``off`` (capture disabled), ``defaults`` (``wj.capture(dir)``:
the calls ledger completed by Flight Recorder, poison of ``to_empty`` only), ``full`` (``ledger="full"``),
``poison_all`` (``poison="all"``), ``full_all`` (both: the defaults before issue 46); compiled (each decoder
layer ``.compile()``-d, torchtitan's way with FSDP2; ``--compile-backend``, default ``inductor`` on GPU,
``aot_eager`` on CPU): ``off`` and ``defaults``. Rank 0 prints a table and writes ``--out`` (JSON: ``step_ms``,
``compiled_step_ms``, ``point_ms``, ``point_ms_first``, ``point_bytes``, and the same per compiled mode).
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

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024, tie_word_embeddings=True),
    "tiny-16": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),  # the 1B's tree
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072),
}
MODES = {"off": dict(enabled=False), "defaults": dict(), "full": dict(ledger="full"),
         "poison_all": dict(poison="all"), "full_all": dict(ledger="full", poison="all")}
COMPILED = ("off", "defaults")


def build(config, device, world: int, compile_backend: str | None):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        if compile_backend:
            layer.compile(backend=compile_backend)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for m in model.modules():  # rope's buffers: to_empty leaves them unwritten
            if hasattr(m, "inv_freq"):
                inv, _ = m.compute_default_rope_parameters(m.config)
                m.inv_freq.copy_(inv.to(device))
                m.original_inv_freq = m.inv_freq.clone()
    return model


def run_mode(name: str, kwargs: dict, args, config, device, world: int, rank: int, runs: str,
             compile_backend: str | None) -> dict:
    import torch

    import workbench.job as wj

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    cap = wj.capture(os.path.join(runs, name + ("-compiled" if compile_backend else "")), **kwargs)
    model = build(config, device, world, compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    step_s, point_s, infos = [], [], []
    warm_s = None
    prof = _profiler(args, rank)
    for i in range(args.steps):
        if prof and i == 2:
            prof["step"].enable()
        ids = torch.randint(1, config.vocab_size, (args.batch, args.seq), generator=g).to(device)
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        step_s.append(time.perf_counter() - t0)
        if prof and i >= 2:
            prof["step"].disable()
            prof["point"].enable()
        t1 = time.perf_counter()
        info = cap.point(f"step{i}", model=model, logits=out.logits)
        sync()
        point_s.append(time.perf_counter() - t1)
        if i == 0:
            warm_s = _await_warm()
        if prof and i >= 2:
            prof["point"].disable()
            if i + 1 < args.steps:
                prof["step"].enable()
        if info:
            infos.append(info)
        del out
    cap.flush()  # a GPU job's points are written on the capture's writer thread: their sizes are known once written
    point_b = [i["bytes"] for i in infos if i.get("bytes") is not None]
    rows = [i["rows"] for i in infos]
    fr = getattr(cap, "_fr", None)  # Flight Recorder's complement: rows it filled, times it read the record
    calls = getattr(cap, "_calls", None)  # the calls ledger: calls it passed to Flight Recorder's record
    fr_stats = {"rows": fr.rows, "dumps": fr.dumps, "passed": calls.passed if calls is not None else None} \
        if fr is not None else None
    cap.close()
    if prof:
        _dump_profile(prof, args, name + ("-compiled" if compile_backend else ""))
    del model, opt
    window = slice(2, None) if args.steps >= 6 else slice(min(1, args.steps - 1), None)
    loop_s = [a + b for a, b in zip(step_s, point_s)] if infos else step_s
    samples = {"step": step_s[window], "loop": loop_s[window], "point": point_s[window] if infos else []}
    return {"step_ms": 1e3 * statistics.median(step_s[window]), "step_ms_first": 1e3 * step_s[0],
            "loop_ms": 1e3 * statistics.median(loop_s[window]),
            "loop_ms_mean": 1e3 * statistics.fmean(loop_s[window]),
            "point_ms": 1e3 * statistics.median(point_s[window]) if point_b else None,
            "point_ms_first": 1e3 * point_s[0] if point_b else None,
            "point_bytes": statistics.median(point_b) if point_b else None, "rows": rows[0] if rows else None,
            "warm_s": warm_s, "samples": samples,
            "flight_recorder": fr_stats}


def _merge(results: list[dict]) -> dict:
    """One mode's rounds as one figure: the medians over every round's window (the first round's first point)."""
    out = dict(results[0])
    if len(results) == 1:
        return out
    for key, part in (("step_ms", "step"), ("loop_ms", "loop"), ("point_ms", "point")):
        xs = [x for r in results for x in r["samples"][part]]
        out[key] = 1e3 * statistics.median(xs) if xs else out[key]
    out["loop_ms_mean"] = 1e3 * statistics.fmean(x for r in results for x in r["samples"]["loop"])
    out["rounds"] = [{k: r[k] for k in ("step_ms", "loop_ms", "point_ms")} for r in results]
    return out


def _await_warm() -> float | None:
    """The fused probe's kernel builds on a thread of its own from the first point on (points take the plain path
    meanwhile: ~0.26 s each at this shape); the measured steps come after it, the steady state a job left on runs
    in. Returns how long the build took (seconds), None where none ran (CPU)."""
    from workbench.rank import probe_fused

    probe_fused.await_warm()
    result = probe_fused._WARM.get("result") or {}
    return result.get("build_s")


def _profiler(args, rank: int) -> dict | None:
    """cProfile of steps 2.. (the job's own step) and of their points, rank 0 only, with ``--profile DIR``."""
    if not args.profile or rank != 0:
        return None
    import cProfile

    return {"step": cProfile.Profile(), "point": cProfile.Profile()}


def _dump_profile(prof: dict, args, name: str) -> None:
    import io
    import pstats

    os.makedirs(args.profile, exist_ok=True)
    for part, p in prof.items():
        buf = io.StringIO()
        pstats.Stats(p, stream=buf).sort_stats("tottime").print_stats(35)
        pstats.Stats(p, stream=buf).sort_stats("cumulative").print_stats(45)
        with open(os.path.join(args.profile, f"{name}-{part}.txt"), "w") as f:
            f.write(buf.getvalue())


def job(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if args.flight_recorder:  # as a capture made before the job's first group turns it on (wj.capture at the top)
        from workbench.rank.ledger_fr import switch_on

        switch_on()
    dist.init_process_group("nccl" if gpu else "gloo", **({"device_id": device} if gpu else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(attn_implementation="sdpa", **SHAPES[args.shape])
    backend = args.compile_backend or ("inductor" if gpu else "aot_eager")
    runs = args.runs or os.path.join(tempfile.gettempdir(), f"wb-job-capture-{os.environ.get('TORCHELASTIC_RUN_ID')}")
    eager: dict[str, dict] = {}
    compiled: dict[str, dict] = {}
    rounds: dict[str, list[dict]] = {}
    for _ in range(args.rounds):  # modes interleaved: a machine that drifts over the run drifts for every mode
        for name in args.modes.split(","):
            rounds.setdefault(name, []).append(run_mode(name, MODES[name], args, config, device, world, rank, runs,
                                                        None))
            dist.barrier()
    eager = {name: _merge(rs) for name, rs in rounds.items()}
    errors: dict[str, str] = {}
    if rank == 0 and args.out:  # the eager figures stay written should the compiled part fail or run out of time
        write(args, eager, {}, errors, gpu, device, backend, world)
    if args.compile:
        import torch._dynamo

        crounds: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            for name in COMPILED:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                try:  # a compiler's failure is the same on every rank: each records it and goes on to the barrier
                    got = run_mode(name, MODES[name], args, config, device, world, rank, runs, backend)
                    got["unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                    crounds.setdefault(name, []).append(got)
                except Exception as exc:
                    errors[f"compiled {name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                dist.barrier()
        compiled = {name: _merge(rs) for name, rs in crounds.items()}
    if rank == 0:
        print(table(write(args, eager, compiled, errors, gpu, device, backend, world)), flush=True)
        for k, v in errors.items():
            print(f"{k}: {v}", flush=True)
    dist.destroy_process_group()


def write(args, eager: dict, compiled: dict, errors: dict, gpu: bool, device, backend: str, world: int) -> dict:
    import torch
    import torch.distributed as dist

    doc = {
        "shape": args.shape, "config": SHAPES[args.shape], "ranks": world, "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "window": f"median of steps 2-{args.steps - 1}"
        + (f", {args.rounds} interleaved rounds" if args.rounds > 1 else ""), "rounds": args.rounds,
        "compile_backend": backend if args.compile else None, "compile_scope": "each decoder layer",
        "flight_recorder_env": {k: os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE",
                                                                "TORCH_NCCL_TRACE_BUFFER_SIZE")},
        "step_ms": {k: round(v["step_ms"], 2) for k, v in eager.items()},
        "loop_ms": {k: round(v["loop_ms"], 2) for k, v in eager.items()},  # the step and its point: the cost
        # the mean too: what a point does every few points (Flight Recorder's read) the median does not show
        "loop_ms_mean": {k: round(v["loop_ms_mean"], 2) for k, v in eager.items()},
        "compiled_step_ms": {k: round(v["step_ms"], 2) for k, v in compiled.items()},
        "compiled_loop_ms": {k: round(v["loop_ms"], 2) for k, v in compiled.items()},
        "compiled_loop_ms_mean": {k: round(v["loop_ms_mean"], 2) for k, v in compiled.items()},
        "point_ms": {k: _r(v["point_ms"]) for k, v in eager.items()},
        "point_ms_first": {k: _r(v["point_ms_first"]) for k, v in eager.items()},
        "point_bytes": {k: v["point_bytes"] for k, v in eager.items()},
        "probe_build_s": {k: _r(v["warm_s"]) for k, v in eager.items()},
        "compiled_point_ms": {k: _r(v["point_ms"]) for k, v in compiled.items()},
        "compiled_unique_graphs": {k: v.get("unique_graphs") for k, v in compiled.items()},
        "flight_recorder_rows": {k: v["flight_recorder"] for k, v in eager.items() if v["flight_recorder"]},
        "errors": errors, "rank0": {"eager": eager, "compiled": compiled},
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def table(doc: dict) -> str:
    off = doc["step_ms"].get("off")
    lines = [f"job capture: {doc['shape']}, {doc['ranks']} ranks, {doc['backend']} on {doc['device']}, torch "
             f"{doc['torch']}, {doc['batch']} x {doc['seq']} tokens a rank, {doc['window']}",
             "| mode | step ms | vs off | point ms (first) | step + point ms | vs off | mean: step + point ms | vs off "
             "| bytes a point |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    moff = doc.get("loop_ms_mean", {}).get("off")
    for k, v in doc["step_ms"].items():
        ratio = f"{v / off:.2f}x" if off else "-"
        loop = doc.get("loop_ms", {}).get(k, v)
        pm, pf, pb = doc["point_ms"].get(k), doc["point_ms_first"].get(k), doc["point_bytes"].get(k)
        mean = doc.get("loop_ms_mean", {}).get(k, v)
        lines.append(f"| {k} | {v:.1f} | {ratio} | " + (f"{pm:.1f} ({pf:.1f})" if pm is not None else "-") +
                     f" | {loop:.1f} | " + (f"{loop / off:.3f}x" if off else "-") + f" | {mean:.1f} | "
                     + (f"{mean / moff:.3f}x" if moff else "-") + f" | {pb if pb is not None else '-'} |")
    coff = doc["compiled_step_ms"].get("off")
    for k, v in doc["compiled_step_ms"].items():
        ratio = f"{v / coff:.2f}x" if coff else "-"
        loop = doc.get("compiled_loop_ms", {}).get(k, v)
        mean, cmoff = doc.get("compiled_loop_ms_mean", {}).get(k, v), doc.get("compiled_loop_ms_mean", {}).get("off")
        pm = doc["compiled_point_ms"].get(k)
        lines.append(f"| compiled ({doc['compile_backend']}) {k} | {v:.1f} | {ratio} | "
                     + (f"{pm:.1f}" if pm is not None else "-") + f" | {loop:.1f} | "
                     + (f"{loop / coff:.3f}x" if coff else "-") + f" | {mean:.1f} | "
                     + (f"{mean / cmoff:.3f}x" if cmoff else "-") + f" | graphs {doc['compiled_unique_graphs'][k]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens a sequence (default: 512; 128 for tiny)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=1, help="the modes this many times, interleaved; medians over all")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--compile-backend", default=None)
    ap.add_argument("--ranks", type=int, default=2, help="CPU only: how many ranks torchrun starts")
    ap.add_argument("--out", default=None, help="rank 0 writes the figures here (JSON)")
    ap.add_argument("--runs", default=None, help="the capture directories (default: one in the temp dir, per job)")
    ap.add_argument("--flight-recorder", action="store_true",
                    help="Flight Recorder on for the job's groups, as a capture made before them turns it on")
    ap.add_argument("--profile", default=None, help="rank 0 writes cProfile tables of steps 2.. and their points here")
    args = ap.parse_args()
    if args.seq is None:
        args.seq = 128 if args.shape == "tiny" else 512
    if "LOCAL_RANK" not in os.environ:  # one command on CPU: start the ranks under torchrun
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
               os.path.abspath(__file__), *sys.argv[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                              os.environ.get("PYTHONPATH", "")])}
        sys.exit(subprocess.run(cmd, env=env).returncode)
    job(args)


if __name__ == "__main__":
    main()
