"""The fused probe kernel's launch shape, swept on the GPU at hand: which one reads nearest the floor.

    python benchmarks/probe_sweep.py                          # the default list, 1.7B shape on cuda:0
    python benchmarks/probe_sweep.py --configs 2048x16x8,1024x16x4 --out sweep.json

A config is words per iteration x iterations per program x warps (``probe_fused.WORDS_PER_ITER``,
``ITERS``, ``NUM_WARPS``), with an optional cap on registers per thread: ``2048x16x8r128``
(``MAXNREG``). For each: the kernel alone (CUDA events, median), the probe end to end (median),
registers and spills, and whether its rows are byte-identical to the committed config's. A
register cap changes only where values live; words, iterations and warps regroup the fp32
partial sums of the mean, so they may move its last bits (the sweep says which do). The model
is ``probe_scale``'s, with its planted NaN, Inf and poison, so the careful loop is exercised too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from probe_scale import build, copy_bandwidth, kernel_ms, plant, ptx_figures, same_bytes, sync, timed  # noqa: E402

from workbench.rank import probe, probe_fused  # noqa: E402

DEFAULT = "2048x16x8,2048x16x8r128,2048x16x8r120,2048x16x8r96,1024x16x4,1024x16x8"


def _parse(text: str) -> tuple[int, int, int, int | None]:
    shape, _, cap = text.partition("r")
    words, iters, warps = (int(v) for v in shape.split("x"))
    return words, iters, warps, int(cap) if cap else None


def _set(config: tuple[int, int, int, int | None]) -> None:
    probe_fused.WORDS_PER_ITER, probe_fused.ITERS, probe_fused.NUM_WARPS, probe_fused.MAXNREG = config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    model = build("1.7b", device)
    plant(model)
    total = sum(t.numel() * t.element_size() for _, _, t in probe.named_tensors(model))
    floor_ms = total / copy_bandwidth(device, min(2 << 30, total // 2)) * 1e3
    committed = (probe_fused.WORDS_PER_ITER, probe_fused.ITERS, probe_fused.NUM_WARPS, probe_fused.MAXNREG)
    reference = probe.probe_module(model, rank=0)
    out = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "floor_ms": floor_ms,
           "committed": list(committed), "configs": []}
    print(f"{out['device']}: floor {floor_ms:.3f} ms; committed {committed}")
    print(f"{'config':>14s} {'kernel ms':>10s} {'e2e ms':>8s} {'regs':>5s} {'spills':>6s}  identical")
    for text in args.configs.split(","):
        config = _parse(text)
        _set(config)
        probe._PLANS.pop(model, None)  # a plan's program count depends on the config
        try:
            k_ms = kernel_ms(lambda: probe.probe_module(model, rank=0), probe_fused, device, args.repeats)
            e2e, rows = timed(lambda: probe.probe_module(model, rank=0), args.repeats, device)
        except Exception as exc:  # a shape this GPU or Triton refuses (registers, shared memory)
            print(f"{text:>14s} refused: {type(exc).__name__}: {str(exc)[:120]}")
            out["configs"].append({"config": list(config), "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        figs = ptx_figures(probe_fused._TRITON.get("last"))
        diff = same_bytes(rows, reference)
        row = {"config": list(config), "kernel_ms": k_ms, "probe_ms": e2e * 1e3, "identical": not diff,
               "diff": diff[:5], **figs}
        out["configs"].append(row)
        print(f"{text:>14s} {k_ms:10.3f} {e2e * 1e3:8.3f} {figs.get('n_regs')!s:>5s} {figs.get('n_spills')!s:>6s}  "
              f"{not diff}")
        sync(device)
    _set(committed)
    ok = [c for c in out["configs"] if c.get("identical")]
    if ok:
        best = min(ok, key=lambda c: c["kernel_ms"])
        out["best"] = best["config"]
        print(f"fastest kernel with the committed rows: {best['config']} {best['kernel_ms']:.3f} ms "
              f"({floor_ms / best['kernel_ms']:.0%} of the floor's speed)")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
