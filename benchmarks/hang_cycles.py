"""Hang -> detect -> recover, N times in a row on the same cluster; then look for leaks.

    .venv/bin/python benchmarks/hang_cycles.py [--ranks 2] [--cycles 20] [--timeout 3] [--deadline 1.5]
                                               [--deaths 1] [--backend gloo|nccl] [--by deadline|ledger]
                                               [--json out.json]

Each cycle: a session whose second step has rank 0 all-reduce alone (the other ranks never
post). ``--by deadline``: a per-step deadline shorter than the collective timeout ends the
wait; ``--by ledger`` (the default on NCCL): the ledgers prove the deadlock (the others
finished the step, rank 0 waits in a call they will never issue). Then, as a user would at
today's cursor semantics (a failed step keeps the cursor): ``s.recover()`` brings the ranks
back and stands the cursor *at* the step that hung, ``s.skip()`` moves past it, and a check
step (every rank all-reduces) must give the right sum. Measured per cycle:
 - detect: seconds from the deadline's expiry (``deadline``), or from the moment the last
   rank blocked to the declaration (``ledger``);
 - the hang frame as ``s.step()`` returned it (``ok`` must be False) and 0.2 s later (unchanged),
   and how the released rank ended (``raised``: its call raised; ``queued``: its code had moved
   past the call, NCCL's queued collective, and the frame says so);
 - recover: ``session.recover()`` (abort through the control threads, re-form, replay); the
   steps it replayed (never the one that hung);
 - device bytes each rank holds after the cycle (it must not grow).
``--deaths`` extra cycles kill the last rank (os._exit) and recover by restarting engines, then go
on. A cycle that raises is reported on one line and the loop goes on after a recovery. At the end:
engine processes alive (only the current ones), the ports of every group formed on the way (all
free again).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback

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

    if ctx.params.get("die") and ctx.rank == dist.get_world_size() - 1:
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


def _state(frame) -> tuple:
    return (frame.ok, sorted(frame.kinds), dict(frame.rank_errors), frame.hang is not None)


def cycle(cluster: wb.Cluster, deadline: float, die: bool, by: str) -> dict:
    n = cluster.world_size
    s = cluster.session(HANG, die=die)
    try:
        s.step()
        s.deadline = deadline
        t0 = time.perf_counter()
        frame = s.step()
        t_step = time.perf_counter() - t0
        at_return = _state(frame)
        time.sleep(0.2)
        settled = _state(frame) == at_return
        if frame.hang is None:
            raise RuntimeError("no hang recorded; events:\n" + frame.events.to_string())
        if die:
            t_detect = t_step  # a death: from the step's start (no deadline involved)
        elif by == "ledger":
            t_detect = frame.hang.to_dict()["detected_after_s"] or float("nan")
        else:
            t_detect = t_step - deadline
        pids = dict(cluster.pids)
        where = "died" if frame.hang.dead else frame.hang.stuck.get(0, "?").split(" at ")[0]
        errors = frame.rank_errors
        how = ("died" if frame.hang.dead else "queued" if "DeadlockReleased" in errors.get(0, "")
               else "raised" if 0 in errors else "none")
        port = cluster.port
        t1 = time.perf_counter()
        info = s.recover()
        t_recover = time.perf_counter() - t1
        at_hung = s.next_step == "lonely"
        if at_hung:
            s.skip()
        out = s.step()
        heads = out.outputs[out.outputs["name"] == "sum"]["head"].tolist() if out.ok else []
        ok = len(heads) == n and all(list(h) == [float(n)] * 4 for h in heads)
    finally:
        s.close()
    mem = cluster.call(_allocated).values
    return {"mem": [mem.get(r) for r in sorted(mem)], "detect_s": t_detect, "recover_s": t_recover,
            "action": info["action"].split(" ")[0], "where": where, "check_ok": ok, "old_port": port,
            "restarted": pids != cluster.pids, "caught_by": frame.hang.caught_by, "ok_at_return": at_return[0],
            "settled": settled, "how": how, "replayed": info["replayed"], "cursor_at_hung": at_hung,
            "replayed_hung": "lonely" in info["replayed"], "error": None}


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


def environment() -> str:
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    return (f"torch {torch.__version__}, NCCL {nccl}, python {platform.python_version()}, "
            f"GPUs: {', '.join(gpus) or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=3.0, help="collective timeout, s")
    ap.add_argument("--deadline", type=float, default=1.5, help="per-step deadline, s")
    ap.add_argument("--deaths", type=int, default=1, help="extra cycles where the last rank dies")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--by", choices=["deadline", "ledger"], default=None,
                    help="what ends the wait (default: ledger on NCCL, deadline on gloo)")
    ap.add_argument("--json", default=None, help="write every cycle's row and the environment here")
    a = ap.parse_args()
    by = a.by or ("ledger" if a.backend == "nccl" else "deadline")

    print(environment(), flush=True)
    t = time.perf_counter()
    cluster = wb.start(ranks=a.ranks, backend=a.backend, timeout=a.timeout, progress=False)
    cluster.detect_deadlocks = by == "ledger"
    deadline = a.deadline if by == "deadline" else max(a.deadline, a.timeout * 3)  # a backstop only
    started = time.perf_counter() - t
    print(f"cluster up in {started:.1f}s: {cluster}", flush=True)
    seen_pids = set(cluster.pids.values())
    rows = []
    try:
        for i in range(a.cycles + a.deaths):
            die = i >= a.cycles
            try:
                r = cycle(cluster, deadline, die, by)
            except Exception as exc:  # one line, then the next cycle on recovered ranks
                r = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "check_ok": False,
                     "old_port": cluster.port, "death": die}
                print(f"{i + 1:>3} {'death' if die else 'hang':<5} FAILED: {r['error']}\n"
                      + "".join(traceback.format_exc().splitlines(True)[-6:]), flush=True)
                try:
                    cluster.recover()
                except Exception as again:
                    print(f"    recovery after the failed cycle failed too: {again}; restarting", flush=True)
                    cluster.restart()
            else:
                r["death"] = die
                print(f"{i + 1:>3} {'death' if die else 'hang':<5} detect {r['detect_s'] * 1000:7.1f} ms  "
                      f"ok at return {r['ok_at_return']!s:<5} settled {r['settled']!s:<5} ({r['how']})  "
                      f"recover {r['recover_s']:5.2f} s {r['action']:<9} replayed {r['replayed']} "
                      f"engines restarted: {'yes' if r['restarted'] else 'no ':<3}  "
                      f"check {'ok' if r['check_ok'] else 'FAILED'}  caught by {r['caught_by']}, stuck in: "
                      f"{r['where']}, device bytes {r['mem']}", flush=True)
            seen_pids |= set(cluster.pids.values())
            rows.append(r)
        current = set(cluster.pids.values())
        leaked = [p for p in engine_processes(seen_pids) if p not in current]
        ports = [r["old_port"] for r in rows if r.get("old_port")]
        busy_ports = listening([p for p in ports if p != cluster.port])
    finally:
        cluster.stop()
    after_stop = engine_processes(seen_pids)

    hangs = [r for r in rows if not r["death"] and not r["error"]]
    deaths = [r for r in rows if r["death"] and not r["error"]]
    failed = [r for r in rows if r["error"]]

    def stats(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.3f}  max {max(xs):.3f}  min {min(xs):.3f}" if xs else "-"

    n_hang = a.cycles
    print()
    print(f"| what ({n_hang} hang cycles, {a.ranks} ranks, {a.backend}, timeout {a.timeout:g}s, by {by}) | |")
    print("| --- | --- |")
    print(f"| cluster start | {started:.1f} s |")
    after = "after the last rank blocked" if by == "ledger" else "after the deadline"
    print(f"| detection latency {after}, s | {stats([r['detect_s'] for r in hangs])} |")
    print(f"| hang frames failed (`ok=False`) when `s.step()` returned them | "
          f"{sum(not r['ok_at_return'] for r in hangs)}/{n_hang} |")
    print(f"| hang frames unchanged 0.2 s later | {sum(r['settled'] for r in hangs)}/{n_hang} |")
    print(f"| how the released rank ended (raised in the call / queued, code moved on) | "
          f"{sum(r['how'] == 'raised' for r in hangs)} / {sum(r['how'] == 'queued' for r in hangs)} |")
    print(f"| recovery (abort through the control threads, re-form, replay), s | "
          f"{stats([r['recover_s'] for r in hangs])} |")
    print(f"| recoveries that replayed the step that hung | {sum(r['replayed_hung'] for r in hangs)}/{n_hang} |")
    print(f"| hang cycles that restarted engines | {sum(r['restarted'] for r in hangs)}/{n_hang} |")
    if a.deaths:
        print(f"| dead rank: detection from step start, s | {stats([r['detect_s'] for r in deaths])} |")
        print(f"| dead rank: recovery (fresh engines), s | {stats([r['recover_s'] for r in deaths])} |")
        print(f"| death cycles recovered and checked right | {sum(r['check_ok'] for r in deaths)}/{a.deaths} |")
    print(f"| hang cycles whose check step gave the right sum | {sum(r['check_ok'] for r in hangs)}/{n_hang} |")
    print(f"| cycles that raised | {len(failed)} |")
    print(f"| recovery actions | {sorted({r['action'] for r in hangs + deaths})} |")
    mems = [r["mem"] for r in hangs + deaths]
    grew = bool(mems) and any((b or 0) > (x or 0) for x, b in zip(mems[0], mems[-1]))
    print(f"| device bytes per rank after the first / last cycle | {mems[0] if mems else '-'} / "
          f"{mems[-1] if mems else '-'} (max {max((max(m) for m in mems if m), default='-')}) |")
    print(f"| stale engine processes alive before stop | {leaked or 'none'} |")
    print(f"| engine processes alive after stop | {after_stop or 'none'} |")
    print(f"| earlier group ports still listening | {busy_ports or 'none'} ({len(set(ports))} ports used) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment(), "args": vars(a), "by": by, "cluster_start_s": started,
                       "rows": rows, "leaked": leaked, "after_stop": after_stop, "busy_ports": busy_ports},
                      f, indent=1, default=str)
    bad = (leaked or after_stop or busy_ports or grew or failed or not all(r["check_ok"] for r in rows)
           or any(r["ok_at_return"] or not r["settled"] or r["replayed_hung"] for r in hangs))
    if bad:
        raise SystemExit("leak, unsettled frame or failed cycle")


if __name__ == "__main__":
    main()
