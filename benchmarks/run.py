"""Cold vs warm: what live ranks buy. Prints one table; run with `make bench`.

- cold `workbench run`: a fresh CLI process (engines start, group forms, scenario runs)
- cold spawn script: the same steps in a plain torch.multiprocessing script
- warm rerun: the whole scenario again on the live ranks of a started cluster
- per-step overhead: a step's wall time on the client minus the slowest rank's own time
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCENARIO, FIX = "fsdp1-rotary-meta-init", "cast-params-only"


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def warm(repeats: int = 5) -> tuple[float, float, float, float]:
    import workbench as wb

    with wb.start(ranks=2, backend="gloo", timeout=8) as cluster:
        start_s, group_s = cluster.start_s, cluster.group_s
        runs, overheads = [], []
        for _ in range(repeats):
            s = cluster.session(SCENARIO, fix=FIX)
            t0 = time.perf_counter()
            for _ in s.steps:
                t1 = time.perf_counter()
                frame = s.step()
                overheads.append(time.perf_counter() - t1 - max(frame.elapsed.values()))
            runs.append(time.perf_counter() - t0)
    return start_s, group_s, statistics.median(runs), statistics.median(overheads)


def main() -> None:
    cold_wb = timed([sys.executable, "-m", "workbench.cli", "run", SCENARIO, "--fix", FIX, "--timeout", "8"])
    cold_spawn = timed([sys.executable, str(HERE / "spawn_baseline.py"), SCENARIO, FIX])
    start_s, group_s, warm_s, step_over = warm()
    rows = [
        ("cold `workbench run` (fix path)", cold_wb, cold_wb / cold_spawn, "x spawn script"),
        ("cold spawn script, same steps", cold_spawn, 1.0, "baseline"),
        ("engine start (2 engines)", start_s, start_s / cold_spawn, "x spawn script"),
        ("process group formation", group_s, group_s / cold_spawn, "x spawn script"),
        ("warm rerun on live ranks", warm_s, cold_spawn / warm_s, "x faster than spawn"),
        ("per-step overhead (client - rank)", step_over, step_over / (warm_s / 4), "of a warm step"),
    ]
    print(f"\n{'measure (this machine, CPU, gloo)':38s} {'seconds':>9s} {'ratio':>8s}")
    for name, secs, ratio, unit in rows:
        print(f"{name:38s} {secs:9.3f} {ratio:8.2f} {unit}")
    gpu_rows()


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
        (f"probe {probe['tensors']} tensors / {probe['bytes'] / 1e9:.2f} GB", fused["probe_ms"] / 1e3),
        ("  floor: bytes / copy bandwidth", probe["floor_ms"] / 1e3),
        ("  fused kernel alone", fused["kernel_ms"] / 1e3),
    ]:
        print(f"{name:38s} {secs:9.4f}")
    print(f"{'  shipped per rank (pickled rows)':38s} {fused['pickled_bytes'] / 1024:8.1f} KB")


if __name__ == "__main__":
    main()
