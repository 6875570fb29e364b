"""NCCL frame-state check: a released deadlock's frame is settled when ``s.step()`` returns it.

    python scripts/gpu_frame_state.py [--backend nccl] [--ranks 2] [--cycles 5] [--out frame_state.json]

Rank 0 all-reduces alone; the ledgers prove the deadlock and the workbench aborts rank 0's
communicators. On NCCL that rank ends one of two ways, and issue 38 saw both, alternating:
 - ``cold``: the all-reduce is the group's first use of its connections; NCCL sets them up inside
   the call, which blocks there on the CPU, and the abort makes it raise;
 - ``warm``: every rank all-reduced once in ``setup``; the lonely call is queued on the GPU and
   returns, the rank waits afterwards (the probe reading ``x``), and the abort ends that wait with
   no exception: the step's code saw nothing.
Each cycle checks: the frame failed (``ok=False``), has its hang and rank 0's error when returned,
and reads the same 0.5 s later (``ok``, kinds, rank errors, the hang's stuck ranks);
``s.recover()`` replayed only ``setup`` and stood the cursor at the step that hung; after
``s.skip()`` the check step's all-reduce gives the right sum. Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import workbench as wb
from workbench import Scenario

LONELY = Scenario(name="frame-state-lonely-all-reduce")


@LONELY.step
def setup(ctx) -> None:
    import torch.distributed as dist

    ctx.x = torch.ones(4, device=ctx.device)
    if ctx.params.get("warm"):
        dist.all_reduce(torch.zeros(4, device=ctx.device))  # the connections are up: the next call is queued
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()


@LONELY.step
def lonely(ctx) -> None:
    import torch.distributed as dist

    if ctx.rank == 0:
        dist.all_reduce(ctx.x)


@LONELY.step
def check(ctx) -> None:
    import torch.distributed as dist

    y = ctx.x.clone()
    dist.all_reduce(y)
    ctx.output("sum", y)


LONELY.params = {"warm": False}


def state(frame) -> dict:
    return {"ok": frame.ok, "kinds": sorted(frame.kinds), "rank_errors": dict(frame.rank_errors),
            "hang": frame.hang is not None, "stuck": sorted(frame.hang.stuck) if frame.hang is not None else None,
            "released": sorted(frame.released)}


def one(cluster: wb.Cluster, warm: bool) -> dict:
    n = cluster.world_size
    cluster.dirty = True  # a fresh group for every cycle: "cold" is then the group's first collective
    s = cluster.session(LONELY, warm=warm)
    row: dict = {"mode": "warm" if warm else "cold"}
    try:
        s.step()
        s.deadline = cluster.timeout * 3  # a backstop: the ledgers declare this deadlock at first sight
        t0 = time.perf_counter()
        frame = s.step()
        row["step_s"] = time.perf_counter() - t0
        row["at_return"] = state(frame)
        time.sleep(0.5)
        row["later"] = state(frame)
        row["error0"] = frame.rank_errors.get(0, "")[:160]
        led = s.ledger
        mine = led[(led["rank"] == 0) & (led["step"] == "lonely")]
        row["ledger0"] = [f"{r.op} #{r.seq}: {r.state} {str(r.error or '')[:90]}" for r in mine.itertuples()]
        t1 = time.perf_counter()
        info = s.recover()
        row["recover_s"] = time.perf_counter() - t1
        row["replayed"] = info["replayed"]
        row["cursor"] = s.next_step
        if s.next_step == "lonely":
            s.skip()
        out = s.step()
        heads = out.outputs[out.outputs["name"] == "sum"]["head"].tolist() if out.ok else []
        row["check_ok"] = len(heads) == n and all(list(h) == [float(n)] * 4 for h in heads)
    except Exception as exc:
        row["exception"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            cluster.recover()
        except Exception:
            cluster.restart()
    finally:
        s.close()
    ar = row.get("at_return") or {}
    row["pass"] = bool(
        "exception" not in row and ar.get("hang") and not ar.get("ok") and 0 in ar.get("rank_errors", {})
        and row.get("later") == ar and row.get("replayed") == ["setup"] and row.get("cursor") == "lonely"
        and row.get("check_ok"))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=5, help="cycles of each mode (cold, warm), interleaved")
    ap.add_argument("--timeout", type=float, default=30.0, help="collective timeout: only the abort frees early")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    env = f"torch {torch.__version__}, NCCL {nccl}, {a.ranks} ranks on {a.backend}, GPUs: {', '.join(gpus) or 'none'}"
    print(env, flush=True)
    t = time.perf_counter()
    cluster = wb.start(ranks=a.ranks, backend=a.backend, timeout=a.timeout, progress=False)
    cluster.detect_deadlocks = True
    print(f"cluster up in {time.perf_counter() - t:.1f}s", flush=True)
    rows = []
    try:
        for i in range(2 * a.cycles):
            r = one(cluster, warm=bool(i % 2))
            rows.append(r)
            ar = r.get("at_return") or {}
            print(f"{i + 1:>2} {r['mode']}: {'PASS' if r['pass'] else 'FAIL'}  at return ok={ar.get('ok')} "
                  f"hang={ar.get('hang')} errors={sorted(ar.get('rank_errors', {}))}; 0.5 s later "
                  f"{'same' if r.get('later') == ar else r.get('later')}; recover replayed {r.get('replayed')} "
                  f"cursor {r.get('cursor')!r}; check {'ok' if r.get('check_ok') else 'FAILED'}"
                  + (f"; {r['exception']}" if "exception" in r else ""), flush=True)
            print(f"     rank 0: {r.get('error0') or '(no error)'}", flush=True)
            print(f"     rank 0's ledger: {r.get('ledger0')}", flush=True)
    finally:
        cluster.stop()
    passed = sum(r["pass"] for r in rows)
    for mode in ("cold", "warm"):
        mine = [r for r in rows if r["mode"] == mode]
        print(f"{mode}: {sum(r['pass'] for r in mine)}/{len(mine)} settled and recovered right; failed at return "
              f"{sum(not (r.get('at_return') or {}).get('ok', True) for r in mine)}/{len(mine)}")
    print(f"frame state: {passed}/{len(rows)} cycles right")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1, default=str)
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
