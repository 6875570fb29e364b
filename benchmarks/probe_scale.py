"""Probe at scale: a full probe of every tensor of a Qwen3-1.7B-shaped model vs the copy floor.

    python benchmarks/probe_scale.py                 # GPU: 1.7B shape on cuda:0; CPU: a small shape
    python benchmarks/probe_scale.py --shape small   # any machine, quick
    python benchmarks/probe_scale.py --out probe.json

The model is random-initialised directly on the device (no download). The floor is the
time to read every tensor once at the device copy bandwidth measured here (bytes read +
written by a large device-to-device copy). Goals: a full probe at >= half the floor's
speed (probe time <= 2 x floor), and <= 256 KB shipped to the client per rank (the
pickled rows, which is what an engine returns). On CUDA both probe paths are timed: the
fused Triton pass (default) and the plain torch path (WORKBENCH_PROBE_FUSED=0), and
their rows are checked against each other after planting NaN, Inf and poison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workbench.rank import probe  # noqa: E402
from workbench.rank.poison import poison_  # noqa: E402

SHAPES = {
    # Qwen3-1.7B (untied head, as measured in FACTS.md: 313 tensors, 4.06 GB bf16)
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=8192),
}
GOAL_SPEED = 0.5  # of the floor's speed
GOAL_BYTES = 256 * 1024


def build(shape: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(tie_word_embeddings=False, max_position_embeddings=4096, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a large device copy (best of several)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / 4)
    del src, dst
    return 2 * nbytes / best


def timed(fn, repeats: int, device: torch.device) -> tuple[float, list]:
    out = fn()
    out = fn()  # warm: Triton compiles, caches fill
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def plant(model: torch.nn.Module) -> dict[str, str]:
    """Known damage, so the two paths are compared on NaN, Inf and poison too."""
    named = dict(model.named_parameters())
    names = list(named)
    with torch.no_grad():
        a, b, c = named[names[1]], named[names[len(names) // 2]], named[names[-2]]
        a.view(-1)[5] = float("nan")
        b.view(-1)[-1] = float("inf")
        poison_(c.data)
        c.data.view(-1)[:3] = 0.5
    return {"nan": names[1], "inf": names[len(names) // 2], "poison": names[-2]}


def compare(rows_a: list[dict], rows_b: list[dict]) -> list[str]:
    bad = []
    for x, y in zip(rows_a, rows_b):
        for k in probe.COLUMNS:
            u, v = x[k], y[k]
            if k == "mean" and isinstance(u, float):
                ok = (u != u and v != v) or math.isclose(u, v, rel_tol=1e-3, abs_tol=1e-6)
            elif isinstance(u, float):
                ok = u == v or (u != u and v != v)
            elif isinstance(u, list):
                ok = len(u) == len(v) and all(p == q or (p != p and q != q) for p, q in zip(u, v))
            else:
                ok = u == v
            if not ok:
                bad.append(f"{x['name']}.{k}: {u!r} vs {v!r}")
    return bad


def kernel_ms(groups: dict, device: torch.device, repeats: int) -> float:
    """Median GPU time of the probe kernels alone (CUDA events), summed over dtype groups."""
    for g in groups.values():
        probe._fused(g)
    sync(device)
    per = []
    for _ in range(repeats):
        probe._KERNEL_EVENTS = []
        for g in groups.values():
            probe._fused(g)
        sync(device)
        per.append(sum(a.elapsed_time(b) for a, b in probe._KERNEL_EVENTS))
        probe._KERNEL_EVENTS = None
    return statistics.median(per)


def kernel_figures(groups: dict, device: torch.device, repeats: int, floor_s: float) -> dict:
    ms = kernel_ms(groups, device, repeats)
    out = {"kernel_ms": ms, "kernel_speed_vs_floor": floor_s * 1e3 / ms,
           "config": [probe.WORDS_PER_ITER, probe.ITERS, probe.NUM_WARPS]}
    last = probe._TRITON.get("last")
    if last is not None:
        ptx = getattr(last, "asm", {}).get("ptx", "")
        out["ptx_v4_loads"] = ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4")
        out["ptx_loads"] = ptx.count("ld.global")
        out["n_regs"] = getattr(last, "n_regs", None)
        out["n_spills"] = getattr(last, "n_spills", None)
    return out


def sweep(groups: dict, device: torch.device, floor_s: float) -> list[dict]:
    """A few kernel shapes (words per iteration, iterations, warps), kernel time each."""
    keep = (probe.WORDS_PER_ITER, probe.ITERS, probe.NUM_WARPS)
    rows = []
    for cfg in [(1024, 8, 4), (2048, 4, 8), (2048, 16, 8), (4096, 8, 8), (4096, 4, 16), (1024, 16, 4)]:
        probe.WORDS_PER_ITER, probe.ITERS, probe.NUM_WARPS = cfg
        try:
            rows.append(kernel_figures(groups, device, 5, floor_s))
        except Exception as exc:
            rows.append({"config": list(cfg), "error": f"{type(exc).__name__}: {exc}"[:300]})
    probe.WORDS_PER_ITER, probe.ITERS, probe.NUM_WARPS = keep
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="also time a few kernel shapes")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = args.shape or ("1.7b" if device.type == "cuda" else "small")
    t0 = time.perf_counter()
    model = build(shape, device)
    sync(device)
    build_s = time.perf_counter() - t0
    planted = plant(model)
    items = probe.named_tensors(model)
    total_bytes = sum(t.numel() * t.element_size() for _, _, t in items)
    bw = copy_bandwidth(device, min(2 << 30, max(64 << 20, total_bytes // 2)))
    floor_s = total_bytes / bw
    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "shape": shape, "tensors": len(items), "bytes": total_bytes,
        "build_s": build_s, "copy_bw_TBps": bw / 1e12, "floor_ms": floor_s * 1e3, "planted": planted,
        "paths": {},
    }

    def run_path(label: str, fused: str) -> list[dict]:
        os.environ["WORKBENCH_PROBE_FUSED"] = fused
        med, rows = timed(lambda: probe.probe_module(model, rank=0), args.repeats, device)
        pick = pickle.dumps(rows)
        js = json.dumps(rows, default=str)
        path = {"probe_ms": med * 1e3, "speed_vs_floor": floor_s / med, "pickled_bytes": len(pick),
                "json_bytes": len(js), "rows": len(rows)}
        if label == "fused" and device.type == "cuda":
            path["fused_active"] = probe.fused_enabled()
            path["fused_note"] = probe._TRITON.get("why", "") or ("alignment hint on" if probe._TRITON.get("hint")
                                                                  else "alignment hint off")
            groups: dict = {}
            for _, _, t in items:
                t = t.detach()
                if probe._fusable(t):
                    groups.setdefault(t.dtype, []).append(t)
            if path["fused_active"] and groups:
                dev_t, _ = timed(lambda: [probe._fused(g) for g in groups.values()] and sync(device),
                                 args.repeats, device)
                path["device_pass_ms"] = dev_t * 1e3
                path["device_pass_speed_vs_floor"] = floor_s / dev_t
                path.update(kernel_figures(groups, device, args.repeats, floor_s))
                path["sweep"] = sweep(groups, device, floor_s) if args.sweep else []
            t1 = time.perf_counter()
            for _ in range(args.repeats):
                probe.named_tensors(model)
            path["named_tensors_ms"] = (time.perf_counter() - t1) / args.repeats * 1e3
        results["paths"][label] = path
        return rows

    rows_plain = run_path("plain", "0")
    rows_main = rows_plain
    if device.type == "cuda":
        rows_main = run_path("fused", "1")
        mism = compare(rows_plain, rows_main)
        results["fused_vs_plain_mismatches"] = mism[:20]
        results["fused_vs_plain_equal"] = not mism
    by_name = {r["name"]: r for r in rows_main}
    results["planted_seen"] = {
        "nan": by_name[planted["nan"]]["nan"], "inf": by_name[planted["inf"]]["inf"],
        "poison": by_name[planted["poison"]]["poisoned"],
    }
    main_path = results["paths"]["fused" if device.type == "cuda" else "plain"]
    results["goal_speed_met"] = main_path["speed_vs_floor"] >= GOAL_SPEED
    results["goal_bytes_met"] = main_path["pickled_bytes"] <= GOAL_BYTES

    print(f"probe at scale: {results['device']}, torch {results['torch']}, shape {shape}: "
          f"{len(items)} tensors, {total_bytes / 1e9:.3f} GB; built in {build_s:.1f}s")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write) -> floor {floor_s * 1e3:.3f} ms")
    hdr = f"{'path':<7} {'probe ms':>9} {'x floor speed':>13} {'device ms':>9} {'pickled KB':>10} {'json KB':>8}"
    print(hdr)
    for label, p in results["paths"].items():
        dev_ms = f"{p['device_pass_ms']:.3f}" if "device_pass_ms" in p else "-"
        print(f"{label:<7} {p['probe_ms']:>9.3f} {p['speed_vs_floor']:>13.3f} {dev_ms:>9} "
              f"{p['pickled_bytes'] / 1024:>10.1f} {p['json_bytes'] / 1024:>8.1f}")
    for label, p in results["paths"].items():
        if "kernel_ms" in p:
            print(f"{label}: kernel alone {p['kernel_ms']:.3f} ms ({p['kernel_speed_vs_floor']:.2f} x floor speed), "
                  f"config {p['config']}, v4 loads {p.get('ptx_v4_loads')}/{p.get('ptx_loads')}, "
                  f"regs {p.get('n_regs')}, spills {p.get('n_spills')}; named_tensors {p['named_tensors_ms']:.2f} ms")
        for row in p.get("sweep", []):
            print(f"  sweep {row['config']}: " + (f"{row['kernel_ms']:.3f} ms, v4 {row.get('ptx_v4_loads')}, "
                                                  f"regs {row.get('n_regs')}" if "kernel_ms" in row else row["error"]))
    print(f"planted: {results['planted_seen']}")
    if "fused_vs_plain_equal" in results:
        print(f"fused == plain rows: {results['fused_vs_plain_equal']} {results['fused_vs_plain_mismatches'][:5]}")
    print(f"goal >= {GOAL_SPEED} x floor speed: {'met' if results['goal_speed_met'] else 'NOT met'}; "
          f"goal <= 256 KB/rank: {'met' if results['goal_bytes_met'] else 'NOT met'}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
