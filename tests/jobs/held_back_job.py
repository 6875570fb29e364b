"""Every collective kind of ``torch.distributed``, with rank 1 held back: rank 0 enters each call first, rank 1 enters
it only once it has read rank 0's start row in the ledger (and looked again ``HOLD`` seconds later), so rank 0
waits inside the call meanwhile. Rank 0 takes the side that must wait for its peer (the receiver, a rooted
call's non-root). Rank 1 prints what it read of rank 0's rows while it held back (``HELD <kind> <states>``), rank
0 what its rows read once both ranks were through (``AFTER <kind> <states>``). ``argv``: the capture's directory,
its ledger mode (``calls``, ``full``), and the kinds to run (default: all).
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import workbench.job as wj
from workbench.rank.ledger import label

HOLD = 0.5  # how long rank 1 looks at rank 0's open row before it joins (a row ended at once is ended by then)
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
out, mode = sys.argv[1], sys.argv[2]
cap = wj.capture(out, ledger=mode, attach=None)
r = dist.get_rank()
peer = 1 - r
book = os.path.join(out, "rank0", "rank0.jsonl")


def t(*shape: int) -> torch.Tensor:
    return torch.ones(*shape)


def batch() -> None:
    ops = [dist.P2POp(dist.irecv, t(4), 1)] if r == 0 else [dist.P2POp(dist.isend, t(4), 0)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def coalescing() -> None:
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(t(4))
        dist.all_reduce(t(2))
    cm.wait()


KINDS = {
    "barrier": lambda: dist.barrier(),
    "monitored_barrier": lambda: dist.monitored_barrier(timeout=timedelta(seconds=120)),
    "all_reduce": lambda: dist.all_reduce(t(4)),
    "async_all_reduce": lambda: dist.all_reduce(t(4), async_op=True).wait(),
    "broadcast": lambda: dist.broadcast(t(4), src=1),
    "reduce": lambda: dist.reduce(t(4), dst=0),
    "gather": lambda: dist.gather(t(4), [t(4), t(4)] if r == 0 else None, dst=0),
    "scatter": lambda: dist.scatter(t(2), [t(2), t(2)] if r == 1 else None, src=1),
    "all_gather": lambda: dist.all_gather([t(4), t(4)], t(4)),
    "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(t(8), t(4)),
    "reduce_scatter": lambda: dist.reduce_scatter(t(2), [t(2), t(2)]),
    "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t(2), t(4)),
    "all_to_all": lambda: dist.all_to_all([t(2), t(2)], [t(2), t(2)]),
    "all_to_all_single": lambda: dist.all_to_all_single(t(4), t(4)),
    "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([t(4), t(2)]),
    "coalescing_manager": coalescing,
    "send_recv": lambda: dist.recv(t(4), src=1) if r == 0 else dist.send(t(4), dst=0),
    "isend_irecv": lambda: (dist.irecv(t(4), src=1) if r == 0 else dist.isend(t(4), dst=0)).wait(),
    "batch_isend_irecv": batch,
    "send_recv_object_list": lambda: dist.recv_object_list([None], src=1) if r == 0 else
    dist.send_object_list([{"a": 1}], dst=0),
    "all_gather_object": lambda: dist.all_gather_object([None, None], {"rank": r}),
    "broadcast_object_list": lambda: dist.broadcast_object_list([{"rank": r}], src=1),
    "scatter_object_list": lambda: dist.scatter_object_list([None], [1, 2] if r == 1 else None, src=1),
    "gather_object": lambda: dist.gather_object(r, [None, None] if r == 0 else None, dst=0),
    "functional_all_reduce": lambda: fc.all_reduce(t(4), "sum", dist.group.WORLD) + 1,
}


def states(kind: str) -> list[str]:
    """Rank 0's rows of ``kind`` (by their label), each call's state: "started" until its end is written."""
    rows: dict[tuple, str] = {}
    with open(book) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # rank 0 is writing this line now: read it next time (json.loads would raise on half a line)
            ev = json.loads(line)
            key = (ev.get("group"), ev.get("seq"))
            if ev["ev"] == "start" and ev.get("label") == kind:
                rows[key] = "started"
            elif ev["ev"] == "end" and key in rows:
                rows[key] = ev["state"]
    return list(rows.values())


def wait_for(kind: str, done: bool) -> list[str]:
    """Rank 0's rows of ``kind`` once one has started (``done``: once all have ended), at most 60 s."""
    end = time.monotonic() + 60
    while True:
        got = states(kind)
        if (got and (not done or "started" not in got)) or time.monotonic() > end:
            return got
        time.sleep(0.02)


for kind in sys.argv[3].split(",") if len(sys.argv) > 3 else KINDS:
    if r == 1:
        wait_for(kind, done=False)
        time.sleep(HOLD)
        print(f"HELD {kind} {json.dumps(states(kind))}", flush=True)
    with label(kind):
        KINDS[kind]()
    dist.barrier()  # both ranks through this kind (a row of no kind; the thread went on past the call)
    if r == 0:
        print(f"AFTER {kind} {json.dumps(wait_for(kind, done=True))}", flush=True)
    dist.barrier()
cap.close()
dist.destroy_process_group()
