"""A real-size model in a session: a user's FSDP2 init of a Qwen3-1.7B-shaped model on N GPUs (issue 38).

    python benchmarks/real_size.py [--ranks 2 4] [--json fixtures/gpu/real_size.json] [--triton-cache fresh]

The user's path: a ``Scenario`` of their own steps (meta build, ``fully_shard`` per layer, ``to_empty``,
seeded init, forward; 28 layers, bf16, tied embeddings, the non-persistent rotary buffers left as
``to_empty`` leaves them), ``wb.start(ranks=N)`` (its two lines, the client's own checks timed apart),
``cluster.session(...)``, one ``s.step()`` at a time, then
the diagnosis, then the same steps again on the same engines (``s.goto(0)`` and on: warm). Per step: the
client's wall time, each rank's step time and probe time (stamped around ``run_step`` on the ranks, as
benchmarks/step_latency.py does), rows; per rank count: start (engines, imports, group), the probe kernel's
warm-up on each rank (rank/probe_fused.warm_async, started when the rank joins its group).

Goals (issue 38), judged per rank count and printed: no step's client time above its slowest rank's step time
by more than 50 ms after the first GPU probe (the probe included: ``make bench``'s overhead); the first GPU
probe (the slowest rank's probe in the first step that holds CUDA tensors) <= 0.5 s; start at 4 GPUs <= 10 s.

``--triton-cache fresh``: each rank count starts with an empty Triton cache (a machine that never built the
kernel); ``--triton-cache DIR``: that one; default: Triton's own (~/.triton/cache). WORKBENCH_PROBE_WARM=0
turns the warm-up off (the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import workbench as wb
from workbench.live.cluster import Cluster

OVERHEAD_GOAL_S = 0.050
FIRST_PROBE_GOAL_S = 0.5
START_GOAL_S = 10.0


SIZES = {  # Qwen3-1.7B's shape; "small": the same code at toy size, for a smoke run on CPU (gloo)
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=1000),
}


def scenario(size: str = "1.7b") -> wb.Scenario:
    sc = wb.Scenario("user-qwen3-1p7b-fsdp2")
    shape = SIZES[size]

    @sc.step
    def build_on_meta(ctx):
        import torch
        from transformers import AutoModelForCausalLM, Qwen3Config

        cfg = Qwen3Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True)
        with torch.device("meta"):
            ctx.model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)

    @sc.step
    def shard(ctx):
        from torch.distributed.fsdp import fully_shard

        for layer in ctx.model.model.layers:
            fully_shard(layer)
        fully_shard(ctx.model)

    @sc.step
    def materialize(ctx):
        ctx.model.to_empty(device=ctx.device)

    @sc.step
    def init_weights(ctx):
        import torch

        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in ctx.model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)

    @sc.step
    def forward(ctx):
        import torch

        ids = torch.arange(256, device=ctx.device).unsqueeze(0) % 1000
        with torch.no_grad():
            out = ctx.model(input_ids=ids).logits
        ctx.output("logits", out.float())

    return sc


# -- on the ranks ------------------------------------------------------------------------------
def _stamp_ranks(gc_freeze: bool = False) -> int:
    """Wrap ``run_step`` to keep (elapsed, probe_s, GC seconds in the step, GC seconds after it, the oldest
    generation collected after it) per call (benchmarks/step_latency.py's way); Python's collections are
    timed through ``gc.callbacks``. ``gc_freeze``: a prototype, not the product's path: the heap is frozen
    (``gc.freeze``) once the step's own code returned and thawed when the next step starts, so a collection
    that falls in the probe or the reply scans only what the probe made."""
    import gc
    import sys
    import time

    from workbench.rank import probe, remote

    kept = sys.__dict__.setdefault("_wb_real_size", [])
    events = sys.__dict__.setdefault("_wb_real_size_gc", [])
    inner = remote.run_step
    if getattr(inner, "_stamped", False):
        return 0

    def on_gc(phase, info):
        if phase == "start":
            events.append([time.perf_counter(), None, info["generation"]])
        elif events and events[-1][1] is None:
            events[-1][1] = time.perf_counter()

    gc.callbacks.append(on_gc)

    def stamped(*args, **kwargs):
        if gc_freeze:
            gc.unfreeze()
        events.clear()
        t_in = time.perf_counter()
        out = inner(*args, **kwargs)
        cut = t_in + out["elapsed"]
        done = [(a, b - a, g) for a, b, g in events if b is not None]
        kept.append((out["elapsed"], out["probe_s"], sum(d for a, d, g in done if a < cut),
                     sum(d for a, d, g in done if a >= cut),
                     max([g for a, d, g in done if a >= cut], default=-1)))
        return out

    if gc_freeze:
        objects = probe.probe_objects

        def frozen_then_probe(*args, **kwargs):
            gc.freeze()
            return objects(*args, **kwargs)

        probe.probe_objects = frozen_then_probe
    stamped._stamped = True
    remote.run_step = stamped
    return 0


def _taken() -> list:
    import sys

    kept = sys.__dict__.get("_wb_real_size", [])
    out = list(kept)
    kept.clear()
    return out


def _warm_state() -> dict:
    from workbench.rank import probe_fused

    t = probe_fused._WARM.get("thread")
    return {**(probe_fused._WARM.get("result") or {}), "running": bool(t is not None and t.is_alive()),
            "hint": probe_fused._TRITON.get("hint")}


def _versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-"}
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    for mod in ("triton", "transformers", "ipyparallel"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = "-"
    return out


# -- the client --------------------------------------------------------------------------------
def _steps(s, cluster, n: int) -> list[dict]:
    """Run ``n`` steps one at a time from the cursor; per step the client's and each rank's times."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        f = s.step()
        client = time.perf_counter() - t0
        out.append({"step": f.step, "ok": bool(f.ok), "client_s": client, "rows": len(f.tensors),
                    "cuda_rows": int((f.tensors["device"].astype(str).str.startswith("cuda")).sum())
                    if len(f.tensors) else 0})
    stamps = cluster.run(_taken)
    for i, row in enumerate(out):
        per = {r: stamps[r][len(stamps[r]) - len(out) + i] for r in sorted(stamps)}  # the last n: a replay's first
        row["rank_s"] = {str(r): v[0] for r, v in per.items()}
        row["probe_s"] = {str(r): v[1] for r, v in per.items()}
        row["gc_step_s"] = {str(r): v[2] for r, v in per.items()}
        row["gc_probe_s"] = {str(r): v[3] for r, v in per.items()}  # collections after the step's code returned
        row["gc_probe_gen"] = {str(r): v[4] for r, v in per.items()}
        row["slowest_gc_probe_s"] = max(v[3] for v in per.values())
        row["slowest_rank_s"] = max(v[0] for v in per.values())
        row["slowest_probe_s"] = max(v[1] for v in per.values())
        row["overhead_s"] = row["client_s"] - row["slowest_rank_s"]  # the probe included (make bench's figure)
        row["outside_probe_s"] = row["client_s"] - max(v[0] + v[1] for v in per.values())
    return out


def one(n: int, triton_cache: str | None, timeout: float, backend: str = "nccl", size: str = "1.7b",
        passes: int = 1, gc_freeze: bool = False) -> dict:
    if triton_cache == "fresh":
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="wb-triton-cache-")
    elif triton_cache:
        os.environ["TRITON_CACHE_DIR"] = triton_cache
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    cache_cold = not (os.path.isdir(cache) and os.listdir(cache))
    torch_before = "torch" in sys.modules
    t0 = time.perf_counter()
    cluster = Cluster(ranks=n, backend=backend, timeout=timeout)  # wb.start's two lines, timed apart: the client's
    init_s = time.perf_counter() - t0  # checks (backend 'nccl' counts GPUs through torch: its import, when cold)
    cluster.progress = False
    cluster.start()
    start_s = time.perf_counter() - t0
    try:
        res: dict = {"ranks": n, "backend": backend, "size": size, "start_s": start_s, "client_init_s": init_s,
                     "client_had_torch": torch_before, "after_group_s": start_s - init_s - sum(
                         x or 0 for x in (cluster.start_s, cluster.imports_s, cluster.group_s)),
                     "engines_s": cluster.start_s, "imports_s": cluster.imports_s,
                     "group_s": cluster.group_s, "triton_cache_cold": cache_cold,
                     "probe_warm": os.environ.get("WORKBENCH_PROBE_WARM", "1") != "0", "passes": passes,
                     "gc_freeze_prototype": gc_freeze}
        res["versions"] = cluster.call(_versions).values[0]
        res["warm_at_start"] = {str(r): v for r, v in cluster.call(_warm_state).values.items()}
        cluster.run(_stamp_ranks, gc_freeze)
        s = cluster.session(scenario(size))
        s.deadline = max(timeout * 3, 180)
        res["cold"] = _steps(s, cluster, len(s.steps))
        res["warm_after_run"] = {str(r): v for r, v in cluster.call(_warm_state).values.items()}
        d = s.diagnose()
        res["diagnosis"] = getattr(d, "sentence", str(d))
        res["warm"] = []
        for _ in range(passes):
            t = time.perf_counter()
            s.goto(0)  # build_on_meta replayed on the same engines
            res["replay_to_0_s"] = time.perf_counter() - t
            cluster.run(_taken)  # the replayed step's stamps
            res["warm"] += _steps(s, cluster, len(s.steps) - 1)
        s.close()
    finally:
        cluster.stop()
    res["goals"] = goals(res)
    return res


def goals(res: dict) -> dict:
    cold = res["cold"]
    first = next((i for i, r in enumerate(cold) if r["cuda_rows"]), None)
    after = cold[first + 1:] + res.get("warm", []) if first is not None else []
    worst = max(after, key=lambda r: r["overhead_s"]) if after else None
    out = {}
    if worst is not None:
        out["overhead"] = {"worst_s": worst["overhead_s"], "step": worst["step"],
                           "worst_outside_probe_s": max(r["outside_probe_s"] for r in after),
                           "worst_less_gc_s": max(r["overhead_s"] - r.get("slowest_gc_probe_s", 0) for r in after),
                           "gc_in_probe_max_s": max(r.get("slowest_gc_probe_s", 0) for r in after),
                           "met": worst["overhead_s"] <= OVERHEAD_GOAL_S, "goal_s": OVERHEAD_GOAL_S}
    if first is not None:
        fp = cold[first]["slowest_probe_s"]
        out["first_probe"] = {"step": cold[first]["step"], "slowest_probe_s": fp,
                              "client_minus_rank_s": cold[first]["overhead_s"],
                              "met": fp <= FIRST_PROBE_GOAL_S, "goal_s": FIRST_PROBE_GOAL_S}
    if res["ranks"] == 4:
        out["start"] = {"start_s": res["start_s"], "met": res["start_s"] <= START_GOAL_S, "goal_s": START_GOAL_S}
    return out


def table(res: dict) -> str:
    v = res["versions"]
    lines = [f"## {res['ranks']} x {v['gpu']} (torch {v['torch']}, NCCL {v.get('nccl', '-')}, triton {v['triton']}, "
             f"transformers {v['transformers']}); Triton cache {'cold' if res['triton_cache_cold'] else 'warm'}, "
             f"probe warm-up {'on' if res['probe_warm'] else 'off'}"
             f"{'; GC FREEZE PROTOTYPE' if res.get('gc_freeze_prototype') else ''}",
             f"start {res['start_s']:.2f} s (client checks {res['client_init_s']:.2f}"
             f"{'' if res['client_had_torch'] else ', torch imported there'}, engines {res['engines_s']:.2f}, "
             f"imports {res['imports_s']:.2f}, group {res['group_s']:.2f}, the rest {res['after_group_s']:.2f})",
             "| pass | step | ok | client s | slowest rank s | slowest probe s | client - rank ms | "
             "outside rank+probe ms | GC in probe ms | rows |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("cold", "warm"):
        for r in res.get(name, []):
            lines.append(f"| {name} | {r['step']} | {r['ok']} | {r['client_s']:.3f} | {r['slowest_rank_s']:.3f} | "
                         f"{r['slowest_probe_s']:.3f} | {r['overhead_s'] * 1e3:.1f} | "
                         f"{r['outside_probe_s'] * 1e3:.1f} | {r['slowest_gc_probe_s'] * 1e3:.1f} | {r['rows']} |")
    for when in ("warm_at_start", "warm_after_run"):
        w = res.get(when, {})
        lines.append(f"probe warm-up ({when}): " + "; ".join(
            f"r{r} " + (f"import {x['import_s']:.2f}s build {x['build_s']:.2f}s" if x.get("warm") else
                        str(x.get("why", "not done")) if not x.get("running") else "running")
            for r, x in sorted(w.items())))
    lines.append(f"replay to step 0: {res['replay_to_0_s']:.2f} s; warm rest: "
                 f"{sum(r['client_s'] for r in res.get('warm', [])):.2f} s")
    lines.append(f"diagnosis: {res['diagnosis']}"[:600])
    for k, g in res["goals"].items():
        detail = {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in g.items() if kk != "met"}
        lines.append(f"goal {k}: {'MET' if g['met'] else 'NOT MET'} {detail}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", default=None)
    ap.add_argument("--triton-cache", default=None, help="'fresh' (empty per rank count), a dir, or Triton's own")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--backend", default="nccl", help="gloo with --size small: a smoke run on CPU")
    ap.add_argument("--size", choices=sorted(SIZES), default="1.7b")
    ap.add_argument("--passes", type=int, default=1, help="warm passes (s.goto(0), then each step again)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="a prototype (not the product's path): the heap frozen from a step's probe to the next step")
    a = ap.parse_args()
    runs = []
    for n in a.ranks:
        res = one(n, a.triton_cache, a.timeout, a.backend, a.size, a.passes, a.gc_freeze)
        runs.append(res)
        print(table(res), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"runs": runs, "commit": os.environ.get("WB_COMMIT", "")}, f, indent=1, default=str)
    firsts = [r["goals"]["first_probe"]["slowest_probe_s"] for r in runs if "first_probe" in r["goals"]]
    if firsts:
        print(f"first GPU probe over {len(firsts)} run(s): median {statistics.median(firsts):.3f} s")
    sys.exit(0 if all(x["ok"] or x["step"] == "forward" for r in runs for x in r["cold"]) else 1)


if __name__ == "__main__":
    main()
