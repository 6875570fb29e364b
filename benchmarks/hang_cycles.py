"""Hang -> detect -> recover, N times in a row on the same cluster; then look for leaks.

    .venv/bin/python benchmarks/hang_cycles.py [--cycles 20] [--timeout 3] [--deadline 1.5] [--deaths 1]
                                               [--backend gloo|nccl] [--by deadline|ledger]

Each cycle: a session whose second step has rank 0 all-reduce alone (rank 1 never
posts). ``--by deadline``: a per-step deadline shorter than the collective timeout ends
the wait; ``--by ledger`` (the default on NCCL): the ledgers prove the deadlock (rank 1
finished the step, rank 0 waits in a call rank 1 will never issue). Measured:
 - detect: seconds from the deadline's expiry (``deadline``), or from the moment the last
   rank blocked to the hang frame (``ledger``);
 - recover: ``session.recover()``: each rank's control thread releases the blocked call
   (NCCL: aborts the communicators; gloo: cuts the group's sockets), the same engines
   re-form the group on a new port, and the setup step is replayed;
 - a check step (both ranks all-reduce) must then give the right sum.
``--deaths`` extra cycles kill rank 1 (os._exit) and recover by restarting engines.
At the end: engine processes alive (only the current ones), the ports of every group
formed on the way (all free again), and the device memory each rank holds after each
cycle (it must not grow).
"""

from __future__ import annotations

import argparse
import statistics
import time

import psutil
import torch

import workbench as wb
from workbench import Scenario

HANG = Scenario(name="bench-lonely-all-reduce")


@HANG.step
def setup(ctx) -> None:
    ctx.x = torch.ones(4, device=ctx.device)  # on the rank's GPU under NCCL


@HANG.step
def lonely(ctx) -> None:
    import os

    import torch.distributed as dist

    if ctx.params.get("die") and ctx.rank == 1:
        os._exit(3)
    if ctx.rank == 0:
        dist.all_reduce(ctx.x)


@HANG.step
def check(ctx) -> None:
    import torch.distributed as dist

    y = ctx.x.clone()
    dist.all_reduce(y)
    ctx.output("sum", y)


HANG.params = {"die": False}


def cycle(cluster: wb.Cluster, deadline: float, die: bool, by: str) -> dict:
    s = cluster.session(HANG, die=die)
    s.step()
    s.deadline = deadline
    t0 = time.perf_counter()
    frame = s.step()
    t_detect = time.perf_counter() - t0 - deadline
    if frame.hang is None:
        raise SystemExit("no hang recorded; events:\n" + frame.events.to_string() + "\nledger:\n"
                         + frame.ledger[["rank", "seq", "op", "state", "error"]].to_string())
    if die:
        t_detect += deadline  # a death: from the step's start (no deadline involved)
    elif by == "ledger":
        t_detect = frame.hang.to_dict()["detected_after_s"] or float("nan")
    pids = dict(cluster.pids)
    where = "died" if frame.hang.dead else frame.hang.stuck.get(0, "?").split(" at ")[0]
    port = cluster.port
    t1 = time.perf_counter()
    info = s.recover()
    t_recover = time.perf_counter() - t1
    out = s.step()
    heads = out.outputs[out.outputs["name"] == "sum"]["head"].tolist() if out.ok else []
    ok = len(heads) == 2 and all(list(h) == [2.0] * 4 for h in heads)
    s.reset()
    mem = cluster.call(_allocated).values
    return {"mem": [mem.get(r) for r in sorted(mem)],
            "detect_s": t_detect, "recover_s": t_recover, "action": info["action"].split(" ")[0],
            "where": where, "check_ok": ok, "old_port": port, "restarted": pids != cluster.pids,
            "caught_by": frame.hang.caught_by}


def _allocated() -> int:
    """Bytes of device memory this rank's torch holds (0 on CPU)."""
    import torch

    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


def listening(ports: list[int]) -> list[int]:
    """Ports someone still listens on (TIME_WAIT leftovers are not leaks)."""
    wanted = set(ports)
    return sorted({c.laddr.port for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in wanted})


def engine_processes(pids: set[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(alive)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=3.0, help="collective (gloo) timeout, s")
    ap.add_argument("--deadline", type=float, default=1.5, help="per-step deadline, s")
    ap.add_argument("--deaths", type=int, default=1, help="extra cycles where rank 1 dies")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--by", choices=["deadline", "ledger"], default=None,
                    help="what ends the wait (default: ledger on NCCL, deadline on gloo)")
    a = ap.parse_args()
    by = a.by or ("ledger" if a.backend == "nccl" else "deadline")

    t = time.perf_counter()
    cluster = wb.start(ranks=2, backend=a.backend, timeout=a.timeout)
    cluster.detect_deadlocks = by == "ledger"
    deadline = a.deadline if by == "deadline" else max(a.deadline, a.timeout * 3)  # a backstop only
    print(f"cluster up in {time.perf_counter() - t:.1f}s: {cluster}")
    seen_pids = set(cluster.pids.values())
    rows = []
    try:
        for i in range(a.cycles + a.deaths):
            die = i >= a.cycles
            r = cycle(cluster, deadline, die, by)
            seen_pids |= set(cluster.pids.values())
            rows.append(r)
            print(f"{i + 1:>3} {'death' if die else 'hang':<5} detect {r['detect_s'] * 1000:7.1f} ms  "
                  f"recover {r['recover_s']:5.2f} s  {r['action']:<9} engines restarted: "
                  f"{'yes' if r['restarted'] else 'no ':<3}  check {'ok' if r['check_ok'] else 'FAILED'}"
                  f"  caught by {r['caught_by']}, stuck in: {r['where']}, device bytes {r['mem']}", flush=True)
        current = set(cluster.pids.values())
        leaked = [p for p in engine_processes(seen_pids) if p not in current]
        ports = [r["old_port"] for r in rows]
        busy_ports = listening([p for p in ports if p != cluster.port])
    finally:
        cluster.stop()
    after_stop = engine_processes(seen_pids)

    hangs = [r for r in rows[: a.cycles]]
    deaths = rows[a.cycles:]

    def stats(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.3f}  max {max(xs):.3f}" if xs else "-"

    print()
    print(f"| what ({len(hangs)} hang cycles, {a.backend}, timeout {a.timeout:g}s, by {by}) | seconds |")
    print("| --- | --- |")
    after = "after the last rank blocked" if by == "ledger" else "after the deadline"
    print(f"| detection latency {after} | {stats([r['detect_s'] for r in hangs])} |")
    print(f"| recovery (abort through the control threads, re-form, replay) | "
          f"{stats([r['recover_s'] for r in hangs])} |")
    if deaths:
        print(f"| dead rank: detection, from step start | {stats([r['detect_s'] for r in deaths])} |")
        print(f"| dead rank: recovery (fresh engines) | {stats([r['recover_s'] for r in deaths])} |")
    print(f"| cycles whose check step gave the right sum | {sum(r['check_ok'] for r in rows)}/{len(rows)} |")
    print(f"| recovery actions | {sorted({r['action'] for r in rows})} |")
    print(f"| hang cycles that restarted engines | {sum(r['restarted'] for r in hangs)}/{len(hangs)} |")
    mems = [r["mem"] for r in rows]
    grew = bool(mems) and any((b or 0) > (a or 0) for a, b in zip(mems[0], mems[-1]))
    print(f"| device bytes per rank after the first / last cycle | {mems[0] if mems else '-'} / "
          f"{mems[-1] if mems else '-'} |")
    print(f"| stale engine processes alive before stop | {leaked or 'none'} |")
    print(f"| engine processes alive after stop | {after_stop or 'none'} |")
    print(f"| earlier group ports still listening | {busy_ports or 'none'} ({len(set(ports))} ports used) |")
    if leaked or after_stop or busy_ports or grew or not all(r["check_ok"] for r in rows):
        raise SystemExit("leak or failed cycle")


if __name__ == "__main__":
    main()
