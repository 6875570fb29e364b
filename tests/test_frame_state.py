"""A frame is settled when ``s.step()`` returns it, also when a released rank never saw its call fail.

On NCCL a collective is queued on the GPU and the call returns at once; the rank then waits on the
GPU (a stream sync, the probe reading a tensor) outside any torch.distributed call. When the ledgers
prove a deadlock and the workbench aborts that rank's communicators, the wait simply ends: the
step's code saw no exception, the rank returns a clean value. The frame read ``ok=True`` with
``hang`` set (on NCCL, every second hang cycle), ``recover()`` found no failed frame and
replayed the step that hung. Here gloo is made to take the same order: rank 0 queues its lonely
all-reduce (``async_op=True``) and polls its completion, as a stream sync does, never calling
``wait()``; the release completes the work (with an error nobody reads) and the step returns clean.
"""

from __future__ import annotations

import time

import pytest
import torch

from workbench import Scenario
from workbench.analysis.cause import is_symptom
from workbench.analysis.frames import Frame
from workbench.live.session import _released_failed

QUEUED = Scenario(name="queued-lonely-all-reduce", title="rank 0 queues an all-reduce alone and waits on it")


@QUEUED.step
def setup(ctx) -> None:
    ctx.x = torch.ones(4)


@QUEUED.step
def lonely(ctx) -> None:
    import time

    import torch.distributed as dist

    if ctx.rank == 0:
        work = dist.all_reduce(ctx.x, async_op=True)  # queued, as every NCCL collective is
        while not work.is_completed():  # waits on it the way a stream sync does: no exception ever reaches here
            time.sleep(0.01)


@QUEUED.step
def check(ctx) -> None:
    import torch.distributed as dist

    y = ctx.x.clone()
    dist.all_reduce(y)
    ctx.output("sum", y)


def _state(frame) -> tuple:
    return (frame.ok, sorted(frame.kinds), dict(frame.rank_errors), frame.hang is not None,
            None if frame.hang is None else frame.hang.caught_by, frame.events.to_dict("records"))


@pytest.mark.slow
def test_a_released_rank_whose_code_saw_no_error_fails_the_frame_when_it_is_returned(healthy):
    assert healthy.detect_deadlocks
    s = healthy.session(QUEUED)
    assert s.step().ok
    s.deadline = 30.0  # a backstop: the ledgers declare this deadlock at first sight
    frame = s.step()
    at_return = _state(frame)
    assert frame.hang is not None and frame.hang.caught_by == "ledger deadlock"
    assert set(frame.released) == {0}
    assert not frame.ok, f"a released deadlock's frame read ok at return: {at_return}"
    assert list(frame.rank_errors) == [0] and "aborted by the workbench" in frame.rank_errors[0]
    assert "all_reduce #1" in frame.rank_errors[0]
    assert not frame.halted  # the incident's collective: the session goes on, as on a rank whose call raised
    time.sleep(0.5)  # whatever the ranks still write (the ledger's end rows) must not change the frame
    assert _state(frame) == at_return
    assert s.frames[1] is frame and s.next_step == "check"
    assert healthy.dirty  # the aborted group is not used again: the next session re-forms it

    info = s.recover()
    assert info["replayed"] == ["setup"], info  # never the step that hung
    assert s.next_step == "lonely"  # a failed step keeps the cursor (rerunning it would hang again)
    s.skip()
    after = s.step()
    assert after.ok and after.hang is None
    sums = after.outputs[after.outputs["name"] == "sum"]
    assert [list(h) for h in sums["head"]] == [[2.0] * 4, [2.0] * 4]
    s.close()


@pytest.mark.slow
def test_recover_never_replays_a_step_that_hung(healthy):
    """A frame that hung is a failed step for ``recover()`` whatever its events say (a frame settled before
    this fix, or a hang no rank raised for): the cursor stands at it, the replay stops before it."""
    s = healthy.session(QUEUED)
    s.step()
    frame = s.step()
    assert frame.hang is not None
    frame._tables["events"] = []  # the pre-fix frame: a hang, no events
    assert frame.ok
    info = s.recover()
    assert info["replayed"] == ["setup"] and s.next_step == "lonely"
    s.close()


def test_the_release_decides_the_frame_from_what_the_client_knows():
    """No cluster: the watch released ranks 0 and 2; rank 0 returned clean (NCCL's queued call), rank 2's call
    raised, rank 1 was never stuck, rank 3 missed the deadline (no value). Only rank 0 gets the release's error,
    worded so the diagnosis reads it as the hang's symptom, not a cause."""

    class Found:
        reason = "rank 1 finished the step; rank 0 waits in all_reduce #1, which rank 1 will never issue"

    class Watch:
        found = Found()
        released = {0: "all_reduce #1 float32 [4] 16 B at x.py:3 lonely", 2: "all_reduce #1 float32 [4] 16 B",
                    3: "all_reduce #1 float32 [4] 16 B"}

    def value(error=None):
        return {"tensors": [], "outputs": [], "elapsed": 0.1, "notes": [], "error": error, "halted": False}

    raised = {"error": "DistBackendError", "message": "NCCL communicator was aborted on rank 2.", "traceback": ""}
    values = {0: value(), 1: value(), 2: value(raised)}
    out = _released_failed(values, Watch())
    assert values[0]["error"] is None  # the ranks' values are not changed in place
    assert out[1] is values[1] and out[2] is values[2] and 3 not in out
    e = out[0]["error"]
    assert e["error"] == "DeadlockReleased" and "all_reduce #1 float32 [4] 16 B at x.py:3 lonely" in e["message"]
    assert "aborted by the workbench" in e["message"].splitlines()[0] and Found.reason in e["message"]
    assert is_symptom(e["traceback"], e["message"])
    frame = Frame.build("lonely", 1, "s", None, out, {})
    assert not frame.ok and sorted(frame.rank_errors) == [0, 2]
