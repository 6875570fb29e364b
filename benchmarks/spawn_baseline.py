"""The same scenario steps as a plain ``torch.multiprocessing.spawn`` script: the cold baseline.

No engines, no probe, no frames: each process joins a gloo group, builds a context and
calls the scenario's own step functions in order. What `workbench run` costs on top of
this is the price of the live ranks.
"""

from __future__ import annotations

import sys
import time
import traceback


def worker(rank: int, world: int, port: int, scenario: str, fix: str | None, timeout: float) -> None:
    from workbench import scenarios
    from workbench.rank import context, poison

    context.init_rank(rank, world, "gloo", port, timeout)
    sc = scenarios.get(scenario)
    ctx = context.new_context("baseline", fix, sc.resolve_params({}), True)
    poison.set_poison(True)
    for name, fn in sc.steps:
        try:
            fn(ctx)
        except Exception:
            print(f"rank {rank} step {name} failed:\n{traceback.format_exc(limit=1)}", file=sys.stderr)
    context.destroy_rank()


def main(scenario: str = "fsdp1-rotary-meta-init", fix: str | None = "cast-params-only", world: int = 2,
         timeout: float = 8.0) -> float:
    import torch.multiprocessing as mp

    from workbench.live.engines import free_port

    t0 = time.perf_counter()
    mp.spawn(worker, args=(world, free_port(), scenario, fix, timeout), nprocs=world, join=True)
    return time.perf_counter() - t0


if __name__ == "__main__":
    fix = sys.argv[2] if len(sys.argv) > 2 else "cast-params-only"
    print(f"{main(sys.argv[1] if len(sys.argv) > 1 else 'fsdp1-rotary-meta-init', None if fix == 'none' else fix):.2f}")
