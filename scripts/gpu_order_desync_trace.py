"""What each rank did, step by step, in weight-sync-order-desync's bug path on N NCCL ranks.

    python scripts/gpu_order_desync_trace.py [--ranks 4] [--scenario weight-sync-order-desync]

For issue 38's rank errors at 4 GPUs (``OutOfMemoryError ... more than 1EB``, ``ValueError: Group ...
is not registered``): per step, the ranks the ledger watch released and the call each sat in, every
rank error (type, first line, the traceback's last frames), whether each rank still has a default
process group afterwards, and the ledger rows of the steps that failed (per rank: op, seq, group,
state). Investigation only: it prints, it judges nothing.
"""

from __future__ import annotations

import argparse
import time

import workbench as wb


def world_state() -> str:
    import torch.distributed as dist

    if not dist.is_initialized():
        return "no default group"
    try:
        from torch.distributed import distributed_c10d as c10d

        return f"world size {dist.get_world_size()}, {len(c10d._world.pg_map)} group(s) registered"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:120]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--scenario", default="weight-sync-order-desync")
    ap.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args()
    cluster = wb.start(ranks=a.ranks, backend=a.backend, timeout=a.timeout, progress=False)
    try:
        s = cluster.session(a.scenario)
        s.deadline = a.timeout * 3
        while not s.done:
            t0 = time.perf_counter()
            f = s.step()
            took = time.perf_counter() - t0
            print(f"== {f.index}:{f.step} {took:.2f}s ok={f.ok} hang={f.hang is not None} "
                  f"released={f.released or '-'} cursor->{s.next_step}", flush=True)
            if f.hang is not None:
                print(f"   proof: {f.hang.proof or f.hang.message}"[:600])
            for e in f.events.itertuples():
                tb = [ln for ln in str(e.traceback or "").splitlines() if ln.strip()][-8:]
                first = str(e.message).splitlines()[0][:300] if e.message else ""
                print(f"   rank {e.rank} {e.kind} {e.error}: {first}")
                for ln in tb:
                    print(f"      | {ln[:200]}")
            for r, ns in sorted(f.notes.items()):
                for n in ns:
                    if "deadlock" in n or "released" in n:
                        print(f"   note rank {r}: {n[:300]}")
            if not f.ok:
                led = f.ledger
                if len(led):
                    for r, g in led.groupby("rank"):
                        tail = g.tail(4)
                        print(f"   ledger rank {r}: {len(g)} calls; last: " + "; ".join(
                            f"{x.op} #{x.seq} g={x.group} {x.state}" + (f" ({str(x.error)[:80]})" if x.error else "")
                            for x in tail.itertuples()))
            if s.cursor == f.index or not f.ok:
                try:
                    alive = cluster.call(world_state, timeout=10)
                    print("   groups: " + "; ".join(f"rank {r}: {v}" for r, v in sorted(alive.values.items()))
                          + "".join(f"; rank {r}: {x.line()}" for r, x in sorted(alive.failures.items())), flush=True)
                except Exception as exc:
                    print(f"   groups: not asked ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
            if s.cursor == f.index:
                print("   (the cursor stays: the step failed where later steps cannot go on)")
                break
        d = s.diagnose()
        print(f"diagnosis ({d.mechanism}): {d.sentence}"[:1200])
        s.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
