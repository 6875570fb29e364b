"""Deadlocks read from the ledgers while a step runs: hand-made ledgers, then a real 2-rank hang."""

from __future__ import annotations

import sys
import time

import pytest

from workbench import Scenario
from workbench.analysis.collectives import OPEN, ledger_table
from workbench.analysis.deadlock import Watch, find


def call(rank, seq, op="all_reduce", dtype="float32", numel=4, state="completed", **kw):
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return {"rank": rank, "session": "s", "attempt": 0, "step": "x", "group": "0", "group_ranks": [0, 1],
            "seq": seq, "op": op, "dtypes": [dtype], "shapes": [[numel]], "numel": numel, "bytes": numel * size,
            "state": state, "t_start": float(seq) + rank / 10, **kw}


def test_matching_open_calls_are_progress_not_a_deadlock():
    led = ledger_table([call(0, 1), call(1, 1), call(0, 2, state=OPEN), call(1, 2, state=OPEN)])
    assert find(led, done=[], ranks=[0, 1]) is None


def test_open_calls_that_cannot_pair_are_a_deadlock():
    led = ledger_table([call(0, 9, state=OPEN), call(1, 9, op="all_gather_into_tensor", numel=73920, state=OPEN)])
    d = find(led, done=[], ranks=[0, 1])
    assert d is not None and set(d.waiting) == {0, 1}
    assert "cannot pair" in d.reason and "all_reduce #9" in d.reason and "all_gather_into_tensor #9" in d.reason
    same_op_other_size = ledger_table([call(0, 3, numel=4, state=OPEN), call(1, 3, numel=8, state=OPEN)])
    assert find(same_op_other_size, done=[], ranks=[0, 1]) is not None


def test_a_rank_that_finished_the_step_leaves_its_peer_waiting_for_ever():
    led = ledger_table([call(0, 1, op="broadcast", src=0), call(1, 1, op="broadcast", src=0),
                        call(0, 2, op="broadcast", src=0, state=OPEN)])
    d = find(led, done=[1], ranks=[0, 1])
    assert d is not None and list(d.waiting) == [0] and list(d.finished) == [1]
    assert d.reason.startswith("rank 1 finished the step after broadcast #1") and "will never issue" in d.reason


def test_a_finished_rank_whose_call_was_another_size_leaves_its_peer_waiting():
    """The NCCL headline: rank 0 sent 256 B at #1 and finished; rank 1 waits in #1 for 833.9 KiB."""
    led = ledger_table([call(0, 1, op="broadcast", numel=64, src=0), call(0, 2, op="broadcast", dtype="bfloat16",
                                                                          numel=426880, src=0),
                        call(1, 1, op="broadcast", dtype="bfloat16", numel=426944, src=0, state=OPEN)])
    d = find(led, done=[0], ranks=[0, 1])
    assert d is not None and list(d.waiting) == [1]
    assert "its call #1 was broadcast #1 float32 [64]" in d.reason and "cannot pair" in d.reason


def test_a_peer_whose_call_of_that_number_was_released_leaves_the_late_caller_waiting():
    """A mesh after a release: rank 1 waited in #5 and was released; rank 0 issues its #5 a step later."""
    led = ledger_table([call(0, 4), call(1, 4), call(1, 5, state="failed"), call(0, 5, state=OPEN)])
    d = find(led, done=[1], ranks=[0, 1])
    assert d is not None and list(d.waiting) == [0]
    assert "already failed" in d.reason and "no peer left" in d.reason
    assert find(ledger_table([call(0, 4), call(1, 4), call(1, 5), call(0, 5, state=OPEN)]), done=[1],
                ranks=[0, 1]) is None  # a completed #5 on the peer: rank 0's may still be its pair


def test_a_rank_still_computing_may_yet_pair():
    led = ledger_table([call(0, 1), call(0, 2, state=OPEN), call(1, 1)])  # rank 1 is between calls, not done
    assert find(led, done=[], ranks=[0, 1]) is None
    assert find(led, done=[0, 1], ranks=[0, 1]) is None  # everyone finished: nothing waits


def test_the_watch_declares_only_a_picture_that_holds():
    """A mispaired call the backend completes anyway (NCCL's silent mis-sized broadcast) is no hang."""
    state = {"led": ledger_table([call(0, 3, numel=4, state=OPEN), call(1, 3, numel=8, state=OPEN)])}
    w = Watch(lambda: state["led"], [0, 1], hold=0.2)
    assert w(set()) is None  # first sight: not yet
    state["led"] = ledger_table([call(0, 3, numel=4), call(1, 3, numel=8)])  # both completed after all
    time.sleep(0.25)
    assert w(set()) is None and w.found is None
    state["led"] = ledger_table([call(0, 4, state=OPEN), call(1, 4, numel=8, state=OPEN)])
    assert w(set()) is None
    time.sleep(0.25)
    assert "cannot pair" in w(set()) and w.found is not None and w.blocked_at == 4.1


@pytest.mark.slow
def test_real_eval_loop_hang_is_declared_from_the_ledgers_before_any_timeout(healthy):
    assert healthy.detect_deadlocks  # the default on gloo too: do not wait for its 8 s timeout
    try:
        s = healthy.session("eval-loop-uneven-batches")
        s.deadline = 60.0
        s.run()
        hang = s.hangs[0].hang
        assert hang.caught_by == "ledger deadlock" and "cannot pair" in hang.proof
        assert "all_reduce #9" in hang.proof and "all_gather_into_tensor #9" in hang.proof
        assert set(hang.stuck) == {0, 1}
        # each stuck rank's Python stack, taken by faulthandler while it sat in the collective
        assert "eval_loop_uneven_batches.py" in hang.stacks[0] and "in all_reduce" in hang.stacks[0]
        assert "in all_gather_single" in hang.stacks[1]
        assert hang.to_dict()["detected_after_s"] > 0  # declared after the last rank blocked, by content
        # released by the workbench: not gloo's timeout, not the deadline
        assert "Timeout" not in set(s.hangs[0].events["error"]) and set(s.hangs[0].released) == {0, 1}
        assert not any("Timed out" in m for m in s.hangs[0].events["message"])
        assert healthy.recover()["action"].startswith("re-formed")  # same engines
    finally:
        healthy.detect_deadlocks = True


def test_two_groups_deadlocked_on_their_own_are_one_proof_that_releases_every_waiter():
    """A user's 4-rank mesh, pairs (0,3) and (1,2), each pair's ranks taking themselves for the root."""
    def bc(rank, group, ranks, src):
        return call(rank, 1, op="broadcast", group=group, group_ranks=ranks, src=src, state=OPEN)

    led = ledger_table([bc(0, "1", [0, 3], 0), bc(3, "1", [0, 3], 3), bc(1, "2", [1, 2], 1), bc(2, "2", [1, 2], 2)])
    d = find(led, done=[], ranks=[0, 1, 2, 3])
    assert d is not None and sorted(d.waiting) == [0, 1, 2, 3] and d.group == "1,2", d
    assert "open calls on group 1 cannot pair" in d.reason and "; and the open calls on group 2" in d.reason
    assert not d.finished  # call numbers of two groups do not compare: the release holds first
    # one pair still computing: nothing is provable for it, and the other pair's proof waits for a settled picture
    assert find(led[led["rank"] != 2], done=[], ranks=[0, 1, 2, 3]) is None


# -- a subgroup a %%px cell formed, outside any step --------------------------------------------------------
PX_GROUPS = {  # what a user's own cell runs on every rank before the step (``%%px``: the engines' namespace)
    "new_group": "import torch.distributed as dist\ng = dist.new_group([0, 1])",
    # (a DeviceMesh dim over all of 2 ranks reuses the world's group: its sockets are known already)
    "new_subgroups": "import torch.distributed as dist\ng, _ = dist.new_subgroups(2)",
}
px_roots = Scenario("px-group-different-roots", probe=None)


@px_roots.step
def roots(ctx):
    import torch
    import torch.distributed as dist

    g = sys.modules["__main__"].g  # the engine's namespace, where the %%px cell left its group
    dist.broadcast(torch.full((4,), float(ctx.rank)), src=ctx.rank, group=g)  # each rank its own root


@pytest.mark.slow
@pytest.mark.parametrize("made_by", sorted(PX_GROUPS))
def test_a_subgroup_a_px_cell_formed_is_released_like_one_a_step_formed(healthy, made_by):
    """The group is formed before any step records (no ledger is on): a hang on it is still declared from the
    ledgers, named by its group, and released; the ranks come back at once, not at the collective timeout."""
    healthy._execute(PX_GROUPS[made_by])  # what a ``%%px`` cell runs
    try:
        name = healthy.run(_px_group_name)[0]
        assert name not in ("0", "default_pg"), name  # a group of its own, not the world's
        s = healthy.session(px_roots)
        frame = s.step()
        d = s.diagnose()
        assert f"part at group {name} call #1 in step `roots` (different roots)" in d.sentence, d.sentence
        assert "did not free" not in d.sentence and "(released by the workbench)" in d.sentence, d.sentence
        assert sorted(frame.released) == [0, 1] and frame.hang.caught_by == "ledger deadlock", frame.rank_errors
        for r, msg in frame.rank_errors.items():  # each released call reads as the workbench's release
            assert "aborted by the workbench: it released broadcast #1" in msg and "Timed out" not in msg, (r, msg)
        assert healthy.wait_idle(5) and not healthy.dead_ranks()  # no rank is left inside the call
    finally:
        if healthy.wait_idle(healthy.timeout + 5):
            healthy._execute("g = None")  # the cell's group is gone with the group the release left unusable


def _px_group_name():
    return sys.modules["__main__"].g.group_name
