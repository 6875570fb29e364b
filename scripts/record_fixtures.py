"""Record a CPU bundle per catalogue scenario: fixtures/bundles/<scenario>.wbundle.

Each bundle holds the bug path and every fix, run to the end on 2 gloo ranks with the
same collective timeout as the test suite, so tests/test_fixtures.py can check that a
fresh run still finds what the recording found (findings, not timings).

    .venv/bin/python scripts/record_fixtures.py            # every scenario
    .venv/bin/python scripts/record_fixtures.py NAME ...   # only these
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "bundles"
TIMEOUT_S = 8.0  # tests/conftest.py TEST_TIMEOUT_S: findings quote the timeout


def _import_heavy() -> None:
    import torch.distributed.fsdp  # noqa: F401
    from transformers import DeepseekV3ForCausalLM, Qwen3ForCausalLM  # noqa: F401  (lazy modules load on use)


def warm(cluster) -> None:
    """Import what the scenarios build from on every rank before a step's deadline counts: on a loaded
    machine a fresh engine's first transformers import alone can pass it, and the recording would hold a
    'build' timeout instead of the incident."""
    cluster.run(_import_heavy, timeout=600)


def pinned(sc) -> dict:
    """The weight-sync scenarios record with the workbench's own receiver: ``auto`` would record vLLM here
    and the stand-in on a machine without it (the GPU image), and a rerun could not know which it was.
    vLLM's path has its own tests (tests/test_vllm_weightsync.py)."""
    return {"receiver": "workbench"} if "receiver" in sc.params else {}


def record(cluster, name: str, out_dir: Path) -> Path:
    from workbench import scenarios
    from workbench.postmortem import bundle

    sc = scenarios.get(name)
    records = []
    for fix in [None, *sc.fixes]:
        if cluster.dead_ranks() or not cluster.wait_idle(cluster.timeout + 15):
            cluster.restart()  # a rank the previous run killed or left stuck
            warm(cluster)
        s = cluster.session(sc, fix=fix, **pinned(sc))
        s.run()
        rec = s.record()
        s.reset()
        f = rec.findings()
        print(f"  {rec.label:32s} {len(rec.steps)} steps, {len(f)} findings, {len(rec.events)} failed-rank events")
        records.append(rec)
    return bundle.save(records, out_dir / f"{name}.wbundle")


def main(argv: list[str] | None = None) -> int:
    import workbench as wb
    from workbench import scenarios

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="scenario ids (default: the whole catalogue)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--timeout", type=float, default=TIMEOUT_S)
    args = p.parse_args(argv)
    names = args.names or scenarios.names()
    for n in names:
        scenarios.get(n)  # unknown names fail before engines start
    failed = []
    t0 = time.perf_counter()
    with wb.start(ranks=2, backend="gloo", timeout=args.timeout) as cluster:
        print(f"{cluster}: engines {cluster.start_s:.1f}s")
        warm(cluster)
        for name in names:
            print(f"{name}")
            t = time.perf_counter()
            try:
                path = record(cluster, name, Path(args.out))
                print(f"  -> {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
                      f"({path.stat().st_size // 1024} KiB, {time.perf_counter() - t:.1f}s)")
            except Exception:
                traceback.print_exc()
                failed.append(name)
            if not cluster.alive or cluster.dead_ranks() or not cluster.wait_idle(cluster.timeout + 15):
                cluster.restart()
                warm(cluster)
    print(f"total {time.perf_counter() - t0:.1f}s; {len(names) - len(failed)} recorded"
          + (f", failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
