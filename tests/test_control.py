"""The control path on 2 real gloo ranks: it answers while a rank is stuck, and recovery after a
hang releases the blocked calls through it and re-forms the group on the same engines, without
waiting out the collective timeout (``wait=0`` below: a rank still blocked would mean a restart)."""

from __future__ import annotations

import pytest
import torch

from workbench import Scenario
from workbench.rank.control import ask

pytestmark = pytest.mark.slow

STUCK = Scenario(name="control-lonely-broadcast", title="rank 0 broadcasts alone")


@STUCK.step
def setup(ctx) -> None:
    ctx.x = torch.ones(3)


@STUCK.step
def lonely_broadcast(ctx) -> None:
    import torch.distributed as dist

    if ctx.rank == 0:
        dist.broadcast(ctx.x, 0)  # rank 1 returns at once: rank 0 waits in the broadcast


@STUCK.step
def together(ctx) -> None:
    import torch.distributed as dist

    y = ctx.x.clone()
    dist.all_reduce(y)
    ctx.output("sum", y)


@pytest.fixture()
def detecting(healthy):
    """The shared cluster with the ledger's deadlock proof on (the default on every backend)."""
    assert healthy.detect_deadlocks
    return healthy


def test_control_thread_answers_on_loopback_only_with_its_token(healthy):
    for r in range(2):
        where = healthy.controls[r]
        assert where["host"] == "127.0.0.1"
        assert healthy.control(r, "ping") == {"ok": True, "pid": healthy.pids[r]}
        assert ask({**where, "token": "guess"}, "abort") == {"error": "wrong token"}
    assert "unknown control command" in healthy.control(0, "bogus")["error"]
    assert "lonely_broadcast" not in healthy.control(0, "stacks")["stacks"]["MainThread"]


def test_one_rank_stuck_is_released_and_the_same_engines_go_on(healthy):
    healthy.detect_deadlocks = False  # the step deadline ends the wait: rank 0 stays blocked for recover() to free
    try:
        _stuck_rank_released_by_recover(healthy)
    finally:
        healthy.detect_deadlocks = True


def _stuck_rank_released_by_recover(healthy):
    pids = dict(healthy.pids)
    s = healthy.session(STUCK)
    s.step()
    s.deadline = 3.0  # before gloo's 8 s timeout: rank 0 is still blocked when the step gives up
    frame = s.step()
    assert frame.hang is not None and list(frame.hang.stuck) == [0]
    main = healthy.control(0, "stacks")["stacks"]["MainThread"]
    assert "lonely_broadcast" in main and "broadcast" in main.splitlines()[-2]  # read while it waits
    assert "lonely_broadcast" in frame.hang.stacks[0]  # the frame holds it too (faulthandler, a local engine)
    healthy.is_local = lambda rank: False  # as for an engine on another host: no signal, the control thread
    try:
        remote = healthy.stacks([0])[0]
    finally:
        del healthy.is_local
    assert remote.startswith("Thread MainThread:") and "lonely_broadcast" in remote
    info = s.recover(wait=0)
    assert info["action"] == "re-formed the process group on the same engines", info
    assert dict(healthy.pids) == pids
    assert all("group socket" in " ".join(info["aborted"][r]) for r in range(2)), info["aborted"]
    assert s.next_step == "lonely_broadcast"  # the cursor stands at the hung step: move past it
    s.skip()
    after = s.step()
    assert after.ok
    assert [list(h) for h in after.outputs[after.outputs["name"] == "sum"]["head"]] == [[2.0] * 3, [2.0] * 3]


def test_both_ranks_blocked_in_different_collectives_are_released(detecting):
    """The eval-loop hang: rank 0 in all_reduce, rank 1 in all_gather. Neither finishes on its own
    before gloo's timeout; cutting the group's sockets releases both."""
    healthy = detecting
    pids = dict(healthy.pids)
    s = healthy.session("eval-loop-uneven-batches")
    s.run(until="load_data")
    s.deadline = 60.0
    frame = s.step()
    assert frame.hang is not None and set(frame.hang.stuck) == {0, 1}
    info = s.recover(wait=0)
    assert info["action"] == "re-formed the process group on the same engines", info
    assert dict(healthy.pids) == pids
    cmp = s.compare("allreduce-has-data-min")
    assert all(f.ok for f in cmp.fixed.frames)
