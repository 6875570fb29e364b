"""The probe's kernel built by NVRTC against Triton's on one GPU: the same rows, its build time, both kernels' time.

    python benchmarks/probe_nvrtc.py --out fixtures/gpu/probe_nvrtc_1gpu.json   # scripts/gpu_job_leave_on.sh

``rank/_probe_nvrtc.py`` is ``_probe_triton``'s kernel in CUDA C, built by NVRTC in about a second; on CUDA the
probe uses it. Its rows must be Triton's: this builds it in a fresh process (the figure a job's first point
meets), runs both kernels over the same ``Plan`` for tensors that take every branch (three dtypes; tails,
one-word and odd-length tensors; NaN, Inf and poison; a tensor of NaN only; a sum that overflows; the
Llama-3.2-1B shape's parameters) and compares every column: exact, except the mean and the sum of squares
(float32 summation order), to 1e-5 of the tensor's root mean square and of the sum of squares. Then the rows
``probe_tensors`` gives (the dispatch a job's point takes) against Triton's columns, the kernels' times over
the Llama parameters (CUDA events, median of 20), and the plain torch path's (what a point cost while Triton
built). Not a test: a measurement, recorded as a fixture that CI re-reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXACT = ("nan", "inf", "poisoned", "min", "max", "head", "fingerprint", "raw", "windows")
CLOSE = ("mean", "sumsq")


def cases(torch, dev) -> dict[str, list]:
    """Named tensor lists that take every branch of the kernel."""
    from workbench.rank import probe_fused as pf

    per = pf.WORDS_PER_ITER * pf.ITERS
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, list] = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        words = 2 if dt != torch.float32 else 1
        sizes = [words * k for k in (1, 2, 3, 4, 63, 150, 1030, per, per + 1, 3 * per + 17)] + [words * 5_000_000]
        ts = [torch.randn(n, generator=g, device=dev).to(dt) for n in sizes]
        bad = [t.clone() for t in ts[4:]]
        for t in bad:  # NaN, Inf, -Inf and poison scattered, one each in a full block and in a tail
            n = t.numel()
            for at, v in ((n // 7, math.nan), (n // 3, math.inf), (n // 2, -math.inf), (n - 1, math.nan)):
                t[at] = v
            bits = {torch.bfloat16: (torch.int16, 0x7FA5), torch.float16: (torch.int16, 0x7D5A),
                    torch.float32: (torch.int32, 0x7FA5A5A5)}[dt]
            t.view(bits[0])[n // 5] = bits[1]
        nan_only = torch.full((words * (per + 5),), math.nan, device=dev, dtype=dt)
        huge = torch.full((words * per,), 3e38 if dt != torch.float16 else 6e4, device=dev, dtype=dt)  # sum overflows
        out[str(dt).replace("torch.", "")] = ts + bad + [nan_only, huge]
    return out


def llama(torch, dev) -> list:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return [p.detach() for p in model.parameters()]


def run_kernel(plan, which: str) -> dict:
    """One launch of ``which`` kernel over ``plan`` (its whole buffer zeroed first), its columns."""
    from workbench.rank import _probe_nvrtc
    from workbench.rank import probe_fused as pf

    plan.buf.zero_()
    if which == "nvrtc":
        _probe_nvrtc.launch(plan)
    else:
        plan.triton(pf._TRITON.get("hint", True))
    return plan.columns(None, plan.copy_back())


def compare(a: dict, b: dict, names: list[str], counts: list[int]) -> list[str]:
    bad = []
    for col in EXACT + CLOSE:
        for i, (x, y) in enumerate(zip(a[col], b[col])):
            if col in CLOSE:  # the scale a float32 sum's rounding is relative to: the root mean square
                scale = max(abs(x), abs(y), math.sqrt(abs(a["sumsq"][i]) / max(1, counts[i])))
                same = (x != x and y != y) or x == y or abs(x - y) <= 1e-5 * scale
            else:
                same = x == y or (isinstance(x, float) and x != x and y != y) or (
                    isinstance(x, list) and len(x) == len(y) and all(u == v or (u != u and v != v)
                                                                     for u, v in zip(x, y)))
            if not same:
                bad.append(f"{names[i]} {col}: triton {str(x)[:80]} nvrtc {str(y)[:80]}")
    return bad


def timed(torch, fn, reps: int = 20) -> float:
    ms = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1))
    return statistics.median(ms)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="probe_nvrtc.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    import torch

    from workbench.rank import _probe_nvrtc, probe
    from workbench.rank import probe_fused as pf

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    torch.empty(1, device=dev)
    cuda_s = time.perf_counter() - t0
    got: dict = {}
    # built as the warm-up builds it: on a thread new to CUDA, which must find the device's context itself
    builder = threading.Thread(target=lambda: got.update(_probe_nvrtc.build(0, pf.WORDS_PER_ITER, pf.ITERS)))
    builder.start()
    builder.join()
    built = dict(got)
    doc: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cuda_start_s": cuda_s,
                 "nvrtc_build": built}
    print(f"nvrtc build {built}", flush=True)
    if not built.get("nvrtc"):
        Path(args.out).write_text(json.dumps(doc, indent=1))
        return 1
    t1 = time.perf_counter()
    assert pf._triton_ok(), pf._TRITON.get("why")
    sets = cases(torch, dev)
    sets["llama-3.2-1b"] = llama(torch, dev)
    mismatches, counted = [], 0
    for name, ts in sets.items():
        plan = pf.Plan(ts)
        names = [f"{name}[{i}] n={t.numel()}" for i, t in enumerate(ts)]
        a, b = run_kernel(plan, "triton"), run_kernel(plan, "nvrtc")
        mismatches += compare(a, b, names, [t.numel() for t in ts])
        counted += len(ts)
    doc["triton_first_s"] = time.perf_counter() - t1
    # the dispatch a job's point takes: probe_tensors (NVRTC's kernel, loaded) against Triton's columns
    ts = sets["bfloat16"] + sets["float32"]
    via = probe.probe_tensors([(f"p{i}", "param", t) for i, t in enumerate(ts)], 0)
    want = run_kernel(pf.Plan(ts), "triton")
    mismatches += compare(want, {c: [r[c] for r in via] for c in EXACT + CLOSE}, [r["name"] for r in via],
                          [t.numel() for t in ts])
    doc.update(tensors=counted, dispatch_rows=len(via), mismatches=mismatches[:40], n_mismatches=len(mismatches),
               identical=not mismatches)
    print(f"{counted} tensors + {len(via)} dispatched rows compared: {len(mismatches)} mismatches", flush=True)
    for m in mismatches[:20]:
        print("  ", m, flush=True)
    params = sets["llama-3.2-1b"]
    plan = pf.Plan(params)
    nbytes = sum(t.numel() * t.element_size() for t in params)
    doc["llama_tensors"], doc["llama_bytes"] = len(params), nbytes
    doc["kernel_ms"] = {"triton": timed(torch, lambda: plan.triton(pf._TRITON.get("hint", True))),
                        "nvrtc": timed(torch, lambda: _probe_nvrtc.launch(plan))}
    os.environ["WORKBENCH_PROBE_FUSED"] = "0"
    p_items = [(f"p{i}", "param", t) for i, t in enumerate(params)]
    torch.cuda.synchronize()
    s = time.perf_counter()
    rows = probe.probe_tensors(p_items, 0)  # the process's first plain point: its kernels load as they run
    doc["plain_first_ms"] = 1e3 * (time.perf_counter() - s)
    # the sum of squares rides in the one copy back; read alone (until 2026-11-29) it was a sync a tensor
    doc["plain_sumsq_exact"] = all(r["sumsq"] == probe._sumsq(t) for r, t in zip(rows, params))
    torch.cuda.synchronize()
    ts_, old_ = [], []
    for _ in range(5):
        s = time.perf_counter()
        probe.probe_tensors(p_items, 0)
        ts_.append(1e3 * (time.perf_counter() - s))
        s = time.perf_counter()
        probe.probe_tensors(p_items, 0)
        for t in params:  # what the plain path did more before: one reduction and one sync a tensor
            float(probe._sumsq_device(t.reshape(-1)))
        old_.append(1e3 * (time.perf_counter() - s))
    doc["plain_point_ms"] = statistics.median(ts_)
    doc["plain_point_ms_with_a_sync_a_tensor"] = statistics.median(old_)
    os.environ.pop("WORKBENCH_PROBE_FUSED")
    print(f"kernel ms {doc['kernel_ms']} over {len(params)} tensors ({nbytes / 1e9:.2f} GB); plain path "
          f"{doc['plain_point_ms']:.1f} ms (first {doc['plain_first_ms']:.1f} ms; with a sync a tensor, as before, "
          f"{doc['plain_point_ms_with_a_sync_a_tensor']:.1f} ms; sum of squares exact: {doc['plain_sumsq_exact']})",
          flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0 if doc["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
