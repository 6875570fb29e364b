"""More ranks: engines, group, steps and views at 2, 4 and 8 ranks (gloo on CPU), plus views at 8-64.

Prints two tables.

1. Live ranks (gloo, CPU). Per world size: engine start, process-group formation, a
   no-op round trip to every rank, the per-step overhead (client wall time minus the
   slowest rank's own time) and a warm run of ``fsdp1-rotary-meta-init`` with fix
   ``cast-params-only``. At the largest world size also the bug path: ranks 1..N-1
   must hold the same corruption, and the grouped view must show them as one row.
2. Views and analysis on synthetic frames (8/16/64/256 ranks x 60 tensors x 4 steps):
   grouping, the status matrix, buffer values, the diagnosis and the whole HTML report;
   time and size. Live rows also give the client's memory and the bytes of rows a step
   ships from the ranks.

On a 2-core machine every rank shares two cores, so 8 ranks measure contention as much
as the workbench: read the trend, not the absolute numbers.

    .venv/bin/python benchmarks/ranks_scale.py [--ranks 2 4 8] [--repeats 2] [--timeout 30]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time

import pandas as pd
import psutil
import torch

SCENARIO, FIX = "fsdp1-rotary-meta-init", "cast-params-only"


# -- live ranks -----------------------------------------------------------------------
def _noop() -> int:
    return os.getpid()


def _run(cluster, fix, overheads=None):
    s = cluster.session(SCENARIO, fix=fix)
    t0 = time.perf_counter()
    for _ in s.steps:
        t1 = time.perf_counter()
        frame = s.step()
        if overheads is not None and frame.elapsed:
            overheads.append(time.perf_counter() - t1 - max(frame.elapsed.values()))
        if "died" in set(frame.events["kind"]):
            break
    return s, time.perf_counter() - t0


def live(ranks: int, repeats: int, timeout: float, bug: bool) -> dict:
    import workbench as wb
    from workbench import viz
    from workbench.analysis import rankgroups
    from workbench.postmortem.report import render

    row: dict = {"ranks": ranks}
    t0 = time.perf_counter()
    with wb.start(ranks=ranks, backend="gloo", timeout=timeout) as cluster:
        row["start+group"] = time.perf_counter() - t0
        row["engine start"], row["group formation"] = cluster.start_s, cluster.group_s
        trips = []
        for _ in range(5):
            t1 = time.perf_counter()
            cluster.run(_noop)
            trips.append(time.perf_counter() - t1)
        row["round trip"] = statistics.median(trips)
        s, row["first run (cold caches)"] = _run(cluster, FIX)
        ok = s.last is not None and s.last.ok
        overheads, runs = [], []
        for _ in range(repeats):
            s, secs = _run(cluster, FIX, overheads)
            runs.append(secs)
            ok = ok and s.last.ok
        row["warm run (fix)"] = statistics.median(runs)
        row["rows shipped per step KB"] = statistics.median(
            len(pickle.dumps(f.tensors)) + len(pickle.dumps(f.outputs)) for f in s.frames) / 1e3
        row["client RSS MB"] = psutil.Process().memory_info().rss / 1e6
        row["per-step overhead"] = statistics.median(overheads)
        groups = rankgroups.group_identical_ranks(s.last.tensors)
        row["fix: rows in view"] = len(groups)
        row["fix ok"] = ok and len(groups) == 1
        if bug:
            t1 = time.perf_counter()
            b, _ = _run(cluster, None)
            row["bug run"] = time.perf_counter() - t1
            frame = next(f for f in b.frames if f.step == "wrap_fsdp1")
            groups = rankgroups.group_identical_ranks(frame.tensors)
            fig = viz.status_matrix(frame.tensors)
            rest = [g for g in groups["ranks"] if 0 not in g]
            row["bug: rows in view"] = len(groups)
            row["bug: ranks 1.. one group"] = rest == [list(range(1, ranks))]
            row["bug: labels"] = " | ".join(fig.data[0].y)
            row["bug: failures"] = "; ".join(f"rank {e.rank} {e.kind}" for e in frame.events.itertuples())
            st = rankgroups.with_status(frame.tensors)
            inv = st[st["name"].str.endswith("rotary_emb.inv_freq") & (st["rank"] > 0)]
            row["bug: inv_freq on ranks 1.."] = ", ".join(sorted(set(inv["status"])))
            heads = {tuple(round(v, 4) for v in list(h)[:3]) for h in inv["head"]}
            row["bug: inv_freq heads"] = str(sorted(heads))
            t1 = time.perf_counter()
            html = render([b.record(), s.record()])
            row["bug+fix report"] = time.perf_counter() - t1
            row["report MB"] = len(html) / 1e6
    return row


# -- synthetic frames -------------------------------------------------------------------
def synthetic_step(n_ranks: int, n_tensors: int, step: str, index: int, odd: int = 3) -> pd.DataFrame:
    """Rank 0 right, ranks 1.. the same garbage (fp32 bytes read as bf16, poison), rank ``odd`` zeros."""
    from workbench.analysis.synthetic import incident_step

    return incident_step(n_ranks, n_tensors, step=step, index=index, odd=odd, weight_numel=1024)


def _timed(fn, repeats: int = 3):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def views(n_ranks: int, n_tensors: int = 60, steps: int = 4) -> dict:
    from workbench import viz
    from workbench.analysis import rankgroups
    from workbench.analysis.frames import EVENT_COLUMNS, OUTPUT_COLUMNS, table
    from workbench.postmortem.record import RunRecord
    from workbench.postmortem.report import render

    names = ["load", "cast", "wrap_fsdp1", "forward"][:steps]
    hist = pd.concat([synthetic_step(n_ranks, n_tensors, s, i) for i, s in enumerate(names)], ignore_index=True)
    last = hist[hist["step_index"] == steps - 1]
    row: dict = {"ranks": n_ranks, "tensors": n_tensors}
    row["group ranks s"], groups = _timed(lambda: rankgroups.group_identical_ranks(last))
    row["rows"] = len(groups)
    row["status matrix s"], fig = _timed(lambda: viz.status_matrix(last))
    row["matrix KB"] = len(fig.to_json()) / 1e3
    row["ungrouped matrix s"], raw = _timed(lambda: viz.status_matrix(last, group=False))
    row["ungrouped KB"] = len(raw.to_json()) / 1e3
    row["buffer values s"], bv = _timed(lambda: viz.buffer_values(hist, "model.rotary_emb.inv_freq"))
    row["buffer traces"] = len(bv.data)
    manifest = {"scenario": SCENARIO, "title": "synthetic", "fix": None, "steps_run": names, "ranks": n_ranks,
                "backend": "gloo", "params": {}, "elapsed": []}
    empty = table([], EVENT_COLUMNS)
    outputs = table([], OUTPUT_COLUMNS)
    for df in (empty, outputs):
        df.insert(0, "step_index", pd.Series(dtype="int64"))
        df.insert(0, "step", pd.Series(dtype="object"))
    rec = RunRecord(manifest, hist, outputs, empty)
    row["diagnose s"], d = _timed(rec.diagnose)
    row["diagnosis names"] = d.sentence[:60]
    row["report s"], html = _timed(lambda: render([rec]), repeats=1)
    row["report MB"] = len(html) / 1e6
    return row


def _print(rows: list[dict], title: str) -> None:
    print(f"\n## {title}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    w = max(len(k) for k in keys)
    for k in keys:
        vals = []
        for r in rows:
            v = r.get(k, "")
            vals.append(f"{v:10.3f}" if isinstance(v, float) else f"{v!s:>10}")
        print(f"{k:{w}s} " + " ".join(vals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="collective timeout (s); 2 cores, 8 ranks: be generous")
    ap.add_argument("--views-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    print(f"cpu cores: {os.cpu_count()}  torch {torch.__version__}")
    view_rows = [views(n) for n in (8, 16, 64, 256)]
    _print(view_rows, "views on synthetic frames (seconds, best of 3; sizes)")
    if args.views_only:
        return
    live_rows = []
    for n in args.ranks:
        live_rows.append(live(n, args.repeats, args.timeout, bug=(n == max(args.ranks))))
        _print(live_rows[-1:], f"live gloo ranks={n} (seconds)")
    _print(live_rows, "live ranks, gloo on CPU (seconds)")


if __name__ == "__main__":
    main()
