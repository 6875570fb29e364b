"""Where a warm point's host time goes (issue 62): the job's thread and the writer's, by function.

    python benchmarks/point_cost.py                       # CPU: a 16-layer Llama of width 64 (146 tensors)
    python benchmarks/point_cost.py --shape llama-3.2-1b  # one GPU: the leave-on job's shape, bf16

One process, one rank, the in-code capture (``wj.capture``), AdamW steps of 2 x ``--seq`` tokens. After
``--warm`` steps with their points (the probe's kernel built, its plans cached), ``--points`` more: each step is
synchronised, then its point is timed on the job's thread (``point_ms``) and the writer drained and timed apart
(``drain_ms``: the JSON line and the manifest, which run on the writer thread of a GPU job and hold the GIL the
job's next step launches with). Then the same points again under cProfile. Prints a table of the medians and the
top functions by own time; ``--out`` writes them as JSON. A point's whole cost is ``point_ms`` + the writer's share;
the leave-on goal (<= 3% of a ~65 ms step on an H200) leaves about 2 ms for both.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from job_leave_on import SHAPES  # the leave-on job's shapes: the same model

SHAPES = {**SHAPES, "cpu-16": dict(SHAPES["tiny"], num_hidden_layers=16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="cpu-16", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--points", type=int, default=20)
    ap.add_argument("--no-logits", dest="logits", action="store_false", help="points of the model alone (as a "
                    "zero-code step point takes them), not the model and the step's logits")
    ap.add_argument("--out")
    args = ap.parse_args()
    import workbench.job as wj

    cap = wj.capture(tempfile.mkdtemp(prefix="point-cost-"))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    seq = args.seq if gpu else min(args.seq, 32)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    config = LlamaConfig(attn_implementation="sdpa", **SHAPES[args.shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device, torch.bfloat16 if gpu else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        ids = torch.randint(1, config.vocab_size, (2, seq), device=device)
        o = model(input_ids=ids, labels=ids)
        o.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return o.logits if args.logits else None

    def objects(logits: torch.Tensor | None) -> dict:
        return {"model": model} if logits is None else {"model": model, "logits": logits}

    for i in range(args.warm):
        cap.point(f"warm{i}", **objects(step()))
        cap.flush()
    step_ms, point_ms, drain_ms = [], [], []
    for i in range(args.points):
        t0 = time.perf_counter()
        logits = step()
        t1 = time.perf_counter()
        cap.point(f"p{i}", **objects(logits))
        t2 = time.perf_counter()
        cap.flush()
        step_ms.append(1e3 * (t1 - t0))
        point_ms.append(1e3 * (t2 - t1))
        drain_ms.append(1e3 * (time.perf_counter() - t2))
    match = rows_match(cap, model, step())
    prof = cProfile.Profile()
    for i in range(args.points):
        logits = step()
        prof.enable()
        cap.point(f"prof{i}", **objects(logits))
        cap.flush()
        prof.disable()
    cap.close()
    rows = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    out = {"shape": args.shape, "logits": args.logits, "device": torch.cuda.get_device_name(device) if gpu else "cpu",
           "torch": torch.__version__, "tensors": rows, "points": args.points,
           "step_ms": round(statistics.median(step_ms), 3), "point_ms": round(statistics.median(point_ms), 3),
           "drain_ms": round(statistics.median(drain_ms), 3), "point_ms_all": [round(x, 3) for x in point_ms],
           "deferred_points": sum(d is not None for d in _TAKEN), "all_points": len(_TAKEN), **match}
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
        out[f"profile_{key}"] = s.getvalue()
    print(f"{'shape':<14}{'device':<22}{'tensors':>8}{'step ms':>10}{'point ms':>10}{'drain ms':>10}{'vs step':>9}")
    share = (out["point_ms"] + out["drain_ms"]) / out["step_ms"]
    print(f"{args.shape:<14}{out['device'][:21]:<22}{rows:>8}{out['step_ms']:>10.2f}{out['point_ms']:>10.3f}"
          f"{out['drain_ms']:>10.3f}{share:>9.3f}")
    print(f"points finished on the writer: {out['deferred_points']} of {out['all_points']}; its rows are the job's "
          f"thread's: {out['rows_match']}")
    print(out["profile_tottime"][:7000])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


_TAKEN: list = []  # per point on the writer path: the deferred point, or None where it ran on the job's thread


def _count_deferred() -> None:
    from workbench.rank import point_deferred

    launch = point_deferred.launch
    point_deferred.launch = lambda *a: _TAKEN.append(launch(*a)) or _TAKEN[-1]


def rows_match(cap, model, logits) -> dict:
    """One more point, then the same state probed on the job's thread as an inline point would: the rows must be
    equal (on a GPU job the point's rows were made on the writer, ``rank/point_deferred.py``)."""
    from workbench.rank import probe, remote, shard_format

    cap.point("check", model=model, **({} if logits is None else {"logits": logits}))
    cap.flush()
    rec = cap.latest
    if logits is not None:
        cap.ctx.output("logits", logits)
    held: dict = {}
    rows = probe.probe_objects({"model": model}, cap.rank, held)
    remote._annotate(rows, {"model": model}, cap.ctx, held)
    outs = probe.probe_dict(cap.ctx.outputs, cap.rank, kind="output")
    remote.annotate_outputs(outs, cap.ctx)
    cap.ctx.outputs.clear()
    cap.ctx.output_extras.clear()
    plain = json.loads(json.dumps({"tensors": rows, "outputs": outs}, default=shard_format.plain))
    same = plain["tensors"] == rec["tensors"] and plain["outputs"] == rec["outputs"]
    return {"rows_match": same, "rows_checked": len(rows) + len(outs)}


if __name__ == "__main__":
    _count_deferred()
    os.environ.setdefault("WORKBENCH_CAPTURE_POISON", "to_empty")
    main()
