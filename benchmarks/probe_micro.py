"""Host-side pieces of the packed GPU probe, timed one by one (min of many): where its Python goes.

    python benchmarks/probe_micro.py        # needs CUDA: the 1.7B shape of probe_scale.py
"""

from __future__ import annotations

import gc
import operator
import sys
import timeit
from collections import deque
from itertools import repeat
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from probe_scale import build, plant  # noqa: E402

from workbench.rank import probe, probe_fused  # noqa: E402


def best(fn, n: int = 50) -> float:
    return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


def best_synced(fn, n: int = 200) -> float:
    """Host time of ``fn`` alone, the device drained before each call (launches must not queue up)."""
    import time

    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return min(times) * 1e6


def interleaved(fa, fb, n: int = 400) -> tuple[float, float]:
    """Medians (us) of ``fa`` and ``fb`` called by turns: a host whose speed drifts (a neighbour's load) moves
    both alike, where one after the other it moved one of them."""
    import statistics
    import time

    ta, tb = [], []
    for _ in range(n):
        for fn, out in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta) * 1e6, statistics.median(tb) * 1e6


def flat_tree_key(mods: list) -> tuple | None:
    """The tree key as it was: every dict's keys and values' ids as one list (a dict's size not read)."""
    import itertools
    import weakref

    live = list(map(weakref.ref.__call__, mods))
    if None in live:
        return None
    dicts = list(itertools.chain.from_iterable(map(probe._DICTS, live)))
    values = itertools.chain.from_iterable(map(dict.values, dicts))
    nonpersistent = list(map(tuple, map(probe._NONPERSISTENT, live)))
    return list(itertools.chain.from_iterable(dicts)), list(map(id, values)), nonpersistent


def main() -> None:
    dev = torch.device("cuda:0")
    model = build("1.7b", dev)
    plant(model)
    probe.probe_module(model, 0)
    cached = probe._PLANS[model]
    plan, static = cached.entry.plan.parts[0][0], cached.entry.static  # its first part (two past SPLIT_BYTES)
    plan.launch()
    cols = plan.columns()
    T = plan.T
    slot = plan.copy_back()
    torch.cuda.synchronize()
    h = slot[0].numpy()
    a = h[: T * probe_fused._ACC].reshape(T, probe_fused._ACC)
    w = h[plan.o_words: plan.o_words + T * 48].view(np.uint32).reshape(T, 96)
    rows = [dict(zip(probe.COLUMNS[:8], (0, *s[:4], False, *s[4:]))) for s in static]
    out = {
        "e2e probe_module": lambda: probe.probe_module(model, 0),
        "fit, launch, rows": lambda: probe._rows(probe._PLANS[model].entry, 0, probe.fit_and_launch(model, "")[1]),
        "  tree key": lambda: probe._tree_key(cached.mods),
        "  tree key, one flat list (before bdcadfd)": lambda: flat_tree_key(cached.mods),
        "  tensor key": lambda: probe._tensor_key(cached.whole, cached.plain),
        "launch (zero, kernel, copy, record)": lambda: plan.columns(None, plan.launch()),
        "  acc.zero_": lambda: plan.acc.zero_(),
        "  kernel launch": lambda: plan._kernel(probe_fused._TRITON["hint"]),
        "  copy_ + record": lambda: plan.columns(None, plan.copy_back()),
        "rows begun (8 keys)": lambda: [{"rank": 0, "name": n, "kind": k, "dtype": d, "device": dv, "is_meta": False,
                                         "shape": sh, "numel": ne} for n, k, d, dv, sh, ne in static],
        "columns (after sync)": lambda: plan.columns(),
        "  host.numpy": lambda: slot[0].numpy(),
        "  heads": lambda: plan._heads(w),
        "  hex decode": lambda: h[plan.o_hexs: plan.o_hexs + T * 96].tobytes().decode("ascii"),
        "  tolist x6": lambda: [a[:, i].tolist() for i in range(6)],
        "fill (10 C loops)": lambda: [deque(map(operator.setitem, rows, repeat(k), cols[k]), maxlen=0)
                                      for k in probe._STAT_COLUMNS],
    }
    torch.cuda.synchronize()
    for name, fn in out.items():
        us = best_synced(fn) if "launch" in name or "zero" in name or "copy" in name else best(fn)
        print(f"{name:40s} {us:9.1f} us", flush=True)
        torch.cuda.synchronize()
    today, flat = interleaved(lambda: probe._tree_key(cached.mods), lambda: flat_tree_key(cached.mods))
    print(f"{'tree key today / one flat list, interleaved':40s} {today:9.1f} / {flat:.1f} us (medians)")
    gc.disable()
    print(f"{'e2e probe_module, gc off':40s} {best(out['e2e probe_module']):9.1f} us")
    gc.enable()
    gc.freeze()
    print(f"{'e2e probe_module, gc frozen':40s} {best(out['e2e probe_module']):9.1f} us")


if __name__ == "__main__":
    main()
