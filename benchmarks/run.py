"""The speed figures, each next to its goal, measured in one run: `make bench`.

- cold `workbench run` vs the same steps as a plain spawn script, with the cold run's phases
- `workbench run --cluster P` attached to warm ranks (`workbench up`), and the client's import floor
- warm rerun of the whole scenario on live ranks vs the spawn script
- per-step overhead: a step's client wall time minus the slowest rank's own step time
  (split: the rank's probe, and the client + transport remainder)
- a trivial call on every rank vs ipyparallel's own ``apply_sync`` (its floor), measured in the same run
- a 4-rank cluster started and stopped, CPU-seconds with its engines forked from one import and the plain way
- the GPU probe (313-tensor Qwen3-1.7B shape): measured here when a GPU is present
  (`benchmarks/probe_scale.py`), else the recorded fixtures/gpu/probe_scale.json
- the incident-scale views table (`benchmarks/ranks_scale.py`: 8/16/64 synthetic ranks)
Timings come from this machine (2 gloo ranks on CPU); the other GPU rows come from the recorded
GPU suite (fixtures/gpu). Speed targets live here, never in tests.

    python benchmarks/run.py [--repeats N] [--ups K]

``--repeats``: warm reruns and attached runs each figure is the median of (default 5); ``--ups``: fresh
`workbench up`s whose first run is timed (default 1; the figure is their median). Each row says the load
average (1 minute) at the start and the end of its measurement: on a shared box it moves every figure.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCENARIO, FIX = "fsdp1-rotary-meta-init", "cast-params-only"


def load() -> float:
    """The 1-minute load average now (what else this box is running)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def loads(before: float, after: float) -> str:
    return f"load {before:.1f}->{after:.1f}"


def timed(cmd: list[str], check: bool = True) -> tuple[float, str]:
    """Wall time and output of ``cmd``; unchecked, a failed run (a step past its deadline on a loaded box)
    still counts its time and says so in the output it returns."""
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=check, capture_output=True, text=True)
    failed = f"FAILED (exit {out.returncode}) " if out.returncode else ""
    return time.perf_counter() - t0, failed + out.stdout


def _noop() -> int:
    return 0


def warm(repeats: int = 5) -> dict[str, float]:
    import workbench as wb
    from workbench.analysis import frames

    probe_s: list[float] = []
    build = frames.Frame.build.__func__

    def spy(cls, step, index, scenario, fix, values, failures):  # the ranks' probe time, per step
        probe_s.append(max(v.get("probe_s", 0.0) for v in values.values()) if values else 0.0)
        return build(cls, step, index, scenario, fix, values, failures)

    frames.Frame.build = classmethod(spy)
    from workbench.rank.byname import RankFn

    load0 = load()
    try:
        with wb.start(ranks=2, backend="gloo", timeout=8) as cluster:
            # warm ranks, as `workbench up` leaves them: imports and first calls, then one untimed run (a cold
            # first step outlasts the 8 s group's step deadline on a loaded box, and is no rerun)
            for fn in ("workbench.rank.remote:warm", "workbench.lab.models:warm_first_calls"):
                cluster.run(RankFn(*fn.split(":")), timeout=300)
            first = cluster.session(SCENARIO, fix=FIX)
            first.run()
            first.close()
            view = cluster._client[cluster._ids]
            floor = statistics.median(_timed_n(lambda: view.apply_sync(_noop), 40))
            trivial = statistics.median(_timed_n(lambda: cluster.run(_noop), 40))
            runs, overheads = [], []
            for _ in range(repeats):
                s = cluster.session(SCENARIO, fix=FIX)
                t0 = time.perf_counter()
                for _ in s.steps:
                    t1 = time.perf_counter()
                    frame = s.step()
                    if frame.elapsed:  # a step that failed on every rank has no rank time to subtract
                        overheads.append(time.perf_counter() - t1 - max(frame.elapsed.values()))
                runs.append(time.perf_counter() - t0)
                s.close()
    finally:
        frames.Frame.build = classmethod(build)
    return {"start_s": cluster.start_s, "group_s": cluster.group_s, "warm_s": statistics.median(runs),
            "overhead_s": statistics.median(overheads), "probe_s": statistics.median(probe_s),
            "floor_s": floor, "trivial_s": trivial, "repeats": repeats, "steps": len(overheads),
            "load": loads(load0, load())}


def cluster_start(ranks: int = 4) -> dict[str, dict[str, float]]:
    """A cluster started and stopped by a fresh client, its engines forked from one import and started the plain
    way (``WORKBENCH_ENGINE_FORK=0``): wall seconds and CPU-seconds (the client and every process it waited for:
    controller, engine set, engines; the engines start no nanny)."""
    import resource

    code = (f"import workbench as wb; c = wb.start(ranks={ranks}, backend='gloo', timeout=20); "
            "assert len(c.run(lambda: 1)) == c.world_size; c.stop()")
    out, load0 = {}, load()
    for name, switch in (("forked", "1"), ("plain", "0")):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                       env={**os.environ, "WORKBENCH_ENGINE_FORK": switch})
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out[name] = {"wall_s": time.perf_counter() - t0,
                     "cpu_s": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime}
    out["load"] = loads(load0, load())
    return out


def _timed_n(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def attached(repeats: int = 5, ups: int = 1) -> dict[str, float]:
    """`workbench run --cluster P` on warm ranks from `workbench up`: how long `up` takes (it returns once the
    ranks' imports are done), the first run right after it, then the median, min and max of ``repeats`` more; and
    the client's own floor: Python importing what the command imports, with no engine touched, and whether
    that import pulled in torch. With ``ups`` > 1, `up` and its first run are taken that many times (a fresh
    cluster each time; the later runs ride on the first ``up``): the medians are reported."""
    import tempfile

    floor_code = ("import sys, workbench.cli, workbench.live.connect, workbench.postmortem.bundle; "
                  f"from workbench import scenarios; scenarios.resolve({SCENARIO!r}); print('torch' in sys.modules)")
    ups_s, firsts, runs = [], [], []
    load0 = load()
    for i in range(ups):
        with tempfile.TemporaryDirectory() as d:
            pdir = str(Path(d) / "profile_bench")
            ups_s.append(timed([sys.executable, "-m", "workbench.cli", "up", "--ranks", "2", "--profile", pdir])[0])
            cmd = [sys.executable, "-m", "workbench.cli", "run", SCENARIO, "--fix", FIX, "--cluster", pdir,
                   "--timeout", "8"]
            try:
                firsts.append(timed(cmd)[0])
                if i == 0:
                    runs = [timed(cmd)[0] for _ in range(repeats)]
            finally:
                subprocess.run([sys.executable, "-m", "workbench.cli", "down", "--profile", pdir],
                               capture_output=True)
    floor, out = timed([sys.executable, "-c", floor_code])
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs),
            "first": statistics.median(firsts), "firsts": firsts, "floor": floor,
            "torch": out.strip() == "True", "up": statistics.median(ups_s), "repeats": repeats,
            "load": loads(load0, load())}


def _phase(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else float("nan")


def installed_bytecode() -> bool:
    """Where ``PYTHONDONTWRITEBYTECODE`` is set, every CLI start would compile the workbench's ~50 modules from
    source (~0.2 s of CPU on the 2-core box), which an installed workbench never does: write their ``.pyc`` once
    first (``compileall`` writes them whatever that variable says), so the figures are what a user's start costs.
    True when it did."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return False
    import compileall

    return bool(compileall.compile_dir(str(HERE.parent / "workbench"), quiet=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="warm reruns and attached runs per figure (median)")
    ap.add_argument("--ups", type=int, default=1, help="fresh `workbench up`s whose first run is timed (median)")
    args = ap.parse_args()
    compiled = installed_bytecode()
    load0 = load()
    cold_wb, out = timed([sys.executable, "-m", "workbench.cli", "run", SCENARIO, "--fix", FIX, "--timeout", "8"],
                         check=False)
    cold_spawn = float(timed([sys.executable, str(HERE / "spawn_baseline.py"), SCENARIO, FIX])[0])
    cold_load = loads(load0, load())
    w = warm(args.repeats)
    att = attached(args.repeats, args.ups)
    starts = cluster_start(4)
    ms = 1e3
    rest = w["overhead_s"] - w["probe_s"] - w["floor_s"]  # the client's and the engines' own share of a step
    rows = [
        ("cold `workbench run` (fix) / spawn script", f"{cold_wb / cold_spawn:.2f}x", "<= 1.3x",
         cold_wb / cold_spawn <= 1.3 and not out.startswith("FAILED"),
         f"{cold_wb:.1f} s vs {cold_spawn:.1f} s{'; the cold run FAILED' if out.startswith('FAILED') else ''}; "
         f"{cold_load}"),
        ("  cold run: engines start", f"{_phase(out, r'engines ([0-9.]+)s'):.2f} s", "", None, "controller + engines"),
        ("  cold run: engines import torch", f"{_phase(out, r'imports ([0-9.]+)s'):.2f} s", "", None,
         "first call on the engines"),
        ("  cold run: process group", f"{_phase(out, r'process group ([0-9.]+)s'):.2f} s", "", None,
         "init_process_group and thread settings"),
        ("attached run via --cluster (`workbench up`)", f"{att['median']:.2f} s", "<= 1 s", att["median"] <= 1.0,
         f"median of {att['repeats']} ({att['min']:.2f}-{att['max']:.2f} s), {cold_wb / att['median']:.1f}x below "
         f"cold; client imports alone {att['floor']:.2f} s{' (torch among them)' if att['torch'] else ' (no torch)'}; "
         f"{att['load']}"),
        ("first run right after `workbench up`", f"{att['first']:.2f} s", "<= 2 s", att["first"] <= 2.0,
         f"median of {len(att['firsts'])} fresh `up`s ({', '.join(f'{x:.2f}' for x in att['firsts'])} s); `up` "
         f"{att['up']:.1f} s, returning once the ranks' imports are done; the later runs' median "
         f"{att['median']:.2f} s"),
        ("warm rerun on live ranks vs spawn script", f"{cold_spawn / w['warm_s']:.1f}x", ">= 50x",
         cold_spawn / w["warm_s"] >= 50, f"{w['warm_s']:.3f} s a rerun (median of {w['repeats']}) vs "
         f"{cold_spawn:.1f} s; {w['load']}"),
        ("per-step overhead (client - slowest rank)", f"{w['overhead_s'] * ms:.1f} ms", "<= 10 ms",
         w["overhead_s"] <= 0.010, f"of which the ranks' probe {w['probe_s'] * ms:.1f} ms and ipyparallel's round "
         f"trip (its floor below) {w['floor_s'] * ms:.1f} ms; the rest {rest * ms:.1f} ms; median of "
         f"{w['steps']} steps"),
        ("4-rank cluster start + stop, CPU (forked engines)", f"{starts['forked']['cpu_s']:.1f} CPU-s", "", None,
         f"plain engines (WORKBENCH_ENGINE_FORK=0) {starts['plain']['cpu_s']:.1f} CPU-s; wall "
         f"{starts['forked']['wall_s']:.1f} s vs {starts['plain']['wall_s']:.1f} s; {starts['load']}"),
        ("trivial call on all ranks (2) / apply_sync", f"{w['trivial_s'] / w['floor_s']:.2f}x", "<= 1.2x",
         w["trivial_s"] <= 1.2 * w["floor_s"],
         f"{w['trivial_s'] * ms:.1f} ms vs ipyparallel apply_sync floor {w['floor_s'] * ms:.1f} ms, same run"),
    ]
    print(f"\n{'figure (this machine: CPU, 2 gloo ranks)':44s} {'now':>10s} {'goal':>9s} {'met':>4s}  note")
    for name, now, goal, met, note in rows:
        flag = "" if met is None else ("yes" if met else "no")
        print(f"{name:44s} {now:>10s} {goal:>9s} {flag:>4s}  {note}")
    if compiled:  # what every CLI start above would have paid, that an install does not
        print("note: PYTHONDONTWRITEBYTECODE is set: the workbench's .pyc were written first (compileall), as an "
              "install has them, so no CLI start above compiled its modules from source (~0.2 s of CPU each)")
    gpu_probe_row()
    gpu_rows()
    scale_table()


def gpu_probe_row() -> None:
    """The GPU probe against its goal: measured now on cuda:0 when there is one, else the recorded run."""
    import json
    import tempfile

    try:
        import torch

        live = torch.cuda.is_available()
    except ImportError:
        live = False
    src = HERE.parent / "fixtures" / "gpu" / "probe_scale.json"
    if live:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "probe.json"
            subprocess.run([sys.executable, str(HERE / "probe_scale.py"), "--out", str(out)], check=True,
                           capture_output=True)
            probe = json.loads(out.read_text())
    else:
        try:
            probe = json.loads(src.read_text())
        except (OSError, ValueError):
            return
    fused = probe["paths"].get("fused")
    if not fused:
        return
    before = probe["paths"].get("before", {})
    where = "measured now" if live else f"recorded ({src.relative_to(HERE.parent)})"
    note = (f"{probe['device']}, {where}; kernel alone {fused['kernel_ms']:.2f} ms, read-once floor "
            f"{probe['floor_ms']:.2f} ms" + (f", before {before['probe_ms']:.1f} ms" if before else "")
            + (f"; rows byte-identical to before: {probe['rows_identical']}" if "rows_identical" in probe else ""))
    name = f"GPU probe, {probe['tensors']} tensors / {probe['bytes'] / 1e9:.2f} GB"
    met = fused["probe_ms"] <= 2.0
    print(f"{name:44s} {fused['probe_ms']:>7.2f} ms {'<= 2 ms':>9s} {'yes' if met else 'no':>4s}  {note}")


def scale_table() -> None:
    """The incident-scale views (synthetic 8/16/64 ranks): `benchmarks/ranks_scale.py --views-only`."""
    out = subprocess.run([sys.executable, str(HERE / "ranks_scale.py"), "--views-only"], capture_output=True,
                         text=True)
    print(out.stdout.rstrip() if out.returncode == 0 else f"\nranks_scale.py failed: {out.stderr.strip()[-300:]}")


def gpu_rows() -> None:
    """The same figures as recorded by the GPU suite (scripts/gpu_suite.sh), for comparison."""
    import json

    fixtures = HERE.parent / "fixtures" / "gpu"
    try:
        meta = json.loads((fixtures / "suite.json").read_text())["meta"]
        probe = json.loads((fixtures / "probe_scale.json").read_text())
    except (OSError, KeyError, ValueError):
        return
    warm = meta.get("warm", {})
    fused = probe["paths"]["fused"]
    print(f"\n{'recorded: ' + str(meta['ranks']) + ' GPUs, ' + meta['backend'] + ', torch ' + meta['torch']:38s}"
          f" {'seconds':>9s}")
    for name, secs in [
        ("engine start", meta["engine_start_s"]),
        ("process group formation", meta["group_s"]),
        (f"warm rerun ({warm.get('scenario')}, fix)", warm.get("warm_s", float("nan"))),
        ("re-form the group", warm.get("reform_group_s", float("nan"))),
        (f"probe {probe['tensors']} tensors / {probe['bytes'] / 1e9:.2f} GB (goal <= 0.002)",
         fused["probe_ms"] / 1e3),
        ("  floor: bytes / copy bandwidth", probe["floor_ms"] / 1e3),
        ("  fused kernel alone", fused["kernel_ms"] / 1e3),
    ]:
        print(f"{name:38s} {secs:9.4f}")
    print(f"{'  shipped per rank (pickled rows)':38s} {fused['pickled_bytes'] / 1024:8.1f} KB")


if __name__ == "__main__":
    main()
