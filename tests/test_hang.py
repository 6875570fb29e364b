"""Real hangs on 2 gloo ranks: detected by the step deadline, diagnosed from the ledgers, recovered."""

from __future__ import annotations

import os

import pytest
import torch

from workbench import Scenario
from workbench.analysis.collectives import first_divergence

pytestmark = pytest.mark.slow

LONELY = Scenario(name="lonely-all-reduce", title="rank 0 all-reduces alone")


@LONELY.step
def setup(ctx) -> None:
    ctx.x = torch.full((4,), float(ctx.rank + 1))


@LONELY.step
def lonely(ctx) -> None:
    import torch.distributed as dist

    if ctx.rank == 0:
        dist.all_reduce(ctx.x)  # rank 1 never posts: rank 0 waits until the group timeout


@LONELY.step
def together(ctx) -> None:
    import torch.distributed as dist

    y = ctx.x.clone()  # ctx.x exists only if recovery replayed ``setup``
    dist.all_reduce(y)
    ctx.output("sum", y)


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, ln in enumerate(f, 1) if text in ln)


def test_real_hang_is_detected_diagnosed_and_recovered(healthy, monkeypatch):
    s = healthy.session(LONELY)
    s.step()
    healthy.detect_deadlocks = False  # the deadline path: the ledgers would declare this at once (test_deadlock)
    s.deadline = 3.0  # well under the 8 s collective timeout: the rank is still inside when we look
    try:
        frame = s.step()
    finally:
        healthy.detect_deadlocks = True
    assert frame.hang is not None
    assert {int(r) for r in frame.events["rank"]} == {0}
    assert "past the 3s deadline" in frame.events.iloc[0]["message"]
    assert list(frame.hang.stuck) == [0] and frame.hang.stuck[0].startswith("all_reduce #1 float32 [4]")
    assert frame.hang.finished == [1]
    assert frame.hang.divergence.kind == "extra" and frame.hang.divergence.ranks == [0]
    # the test's own line, shipped by value (cloudpickle's <dynamic-code>), past poison's TorchFunctionMode
    assert frame.ledger.loc[0, "user_frame"].endswith(f"test_hang.py:{_line('dist.all_reduce(ctx.x)')} lonely")
    assert frame.ledger.loc[0, "caller"] == frame.ledger.loc[0, "user_frame"]

    asked: list[tuple[int, str]] = []
    control = healthy.control

    def record(rank: int, cmd: str, **kw):
        asked.append((rank, cmd))
        return control(rank, cmd, **kw)

    monkeypatch.setattr(healthy, "control", record)
    info = s.recover()
    monkeypatch.undo()
    # Every rank knows the abort is ours before any rank cuts its sockets: an idle rank's cut wakes the
    # stuck one with "Connection closed by peer", which its ledger must still call the recovery's doing.
    cmds = [c for _, c in asked]
    assert sorted(asked[:2]) == [(0, "mark"), (1, "mark")] and cmds[2:] == ["abort", "abort"], asked
    assert info["action"].startswith("re-formed") and info["replayed"] == ["setup"]
    assert not healthy.needs_recovery
    assert s.steps[s.cursor] == "lonely"  # a failed step keeps the cursor: rerunning it would hang again
    s.skip()
    after = s.step()
    assert after.ok and after.hang is None
    sums = after.outputs[after.outputs["name"] == "sum"]
    assert [list(h) for h in sums["head"]] == [[3.0] * 4, [3.0] * 4]
    led = s.ledger
    assert set(led["attempt"]) == {0, 1}
    # Released by recovery's abort (the control thread), not by gloo's 8 s timeout: the ledger says which.
    first = led[led["attempt"] == 0]
    assert first["state"].tolist() == ["failed"]
    assert first["error"].iloc[0].startswith("aborted by the workbench's recovery")


def test_eval_loop_bug_hangs_all_reduce_vs_all_gather_and_fix_agrees(healthy):
    s = healthy.session("eval-loop-uneven-batches")
    s.run(until="load_data")
    assert [n for f in s.frames for ns in f.notes.values() for n in ns if "validation batches" in n] == \
        ["7 validation batches on this rank", "9 validation batches on this rank"]
    s.deadline = 4.0
    frame = s.step()
    hang = frame.hang
    assert hang is not None and set(hang.stuck) == {0, 1}
    last = hang.ranks.set_index("rank")
    assert last.loc[0, "op"] == "all_reduce" and last.loc[1, "op"] == "all_gather_into_tensor"
    assert last.loc[0, "seq"] == last.loc[1, "seq"]  # the same position on the group: they cannot pair
    assert hang.divergence.kind == "op" and hang.divergence.seq == last.loc[0, "seq"]
    assert "rank 0: inside all_reduce" in hang.message

    cmp = s.compare("allreduce-has-data-min")  # recovers the cluster first, then runs the fix
    fixed = cmp.fixed
    assert all(f.ok and f.hang is None for f in fixed.frames)
    losses = fixed.outputs[fixed.outputs["name"] == "loss"]["head"].map(lambda h: h[0]).tolist()
    assert len(losses) == 2 and losses[0] == losses[1] and 0 < losses[0] < 20
    assert first_divergence(fixed.ledger) is None
    assert set(fixed.ledger["op"]) == {"all_gather_into_tensor", "all_reduce"}


def test_headline_ledger_names_rank0_extra_fp32_broadcast(healthy):
    s = healthy.session("fsdp1-rotary-meta-init")
    s.run(until="wrap_fsdp1")
    wrap = s.frames[-1]
    assert callable(s.frames[0]._ledger)  # a clean step's table waits until someone reads it
    assert set(s.frames[0].ledger["step"]) <= {"load"}
    div = first_divergence(wrap.ledger)
    assert div is not None and div.kind == "extra" and div.rank == 0 and div.seq == 1
    c = div.call
    assert (c["op"], c["dtypes"], int(c["bytes"]), int(c["bucket_tensors"])) == ("broadcast", "float32", 256, 2)
    assert c["via"] == "_broadcast_coalesced"
    other = div.calls[1]
    assert (other["dtypes"], int(other["bucket_tensors"])) == ("bfloat16", 27)
    led = wrap.ledger.set_index(["rank", "seq"])
    assert int(led.loc[(0, 2), "bucket_tensors"]) == 25 and led.loc[(0, 2), "dtypes"] == "bfloat16"
    assert "torch/distributed/utils.py" in led.loc[(0, 1), "caller"]
    fixed = healthy.session("fsdp1-rotary-meta-init", fix="cast-params-only")
    fixed.run(until="wrap_fsdp1")
    assert fixed.frames[-1].ok and first_divergence(fixed.ledger) is None


def test_dead_rank_is_recovered_with_fresh_engines(healthy):
    die = Scenario(name="rank-dies")

    @die.step
    def exit_rank1(ctx) -> None:
        if ctx.rank == 1:
            os._exit(3)

    s = healthy.session(die)
    frame = s.step()
    assert frame.hang is not None and frame.hang.dead == [1]
    old = dict(healthy.pids)
    info = healthy.recover()
    assert info["action"] == "restarted the engines" and info["dead"] == [1]
    assert set(healthy.pids.values()).isdisjoint(old.values())
    assert healthy.run(lambda: 1 + 1) == {0: 2, 1: 2}



SLOW = Scenario(name="slow-not-stuck", title="both ranks compute past the step deadline, then meet",
                params={"go": ""})


@SLOW.step
def crunch(ctx) -> None:
    import time

    import torch.distributed as dist

    while not os.path.exists(ctx.params["go"]):  # outside any collective (a loaded machine, a big model) until
        time.sleep(0.01)  # the client has judged the ranks busy past the deadline: no sleep raced against it
    x = torch.ones(2)
    dist.all_reduce(x)
    ctx.output("sum", x)


def _completed_by(s, step: str) -> set[int]:
    return {int(r["rank"]) for r in s._ledger_rows(step) if r.get("state") == "completed"}


def _wait_for(done, bound_s: float = 60.0) -> None:
    import time

    end = time.monotonic() + bound_s  # a bound, not a verdict: the assertions below say what happened
    while not done() and time.monotonic() < end:
        time.sleep(0.02)


def test_ranks_computing_past_the_deadline_are_slow_not_hung(healthy, monkeypatch, tmp_path):
    """The ranks leave their work only once the session has asked, past the step's deadline, whether they compute
    outside any collective (and was told they do): the step surely outlives its deadline, whatever the box's speed,
    and the workbench must read that as slow, not hung. It asks again until the step ends (up to 5 deadlines); a
    rank inside a collective then ends the grace, so a later answer is read once the ranks' all-reduce is over (on
    a loaded box a rank may enter it a second after its peer). Before, a 4.5 s sleep raced the 3 s deadline."""
    go = tmp_path / "go"
    s = healthy.session(SLOW, go=str(go))
    answers: list[bool] = []
    judge = s._outside_collectives

    def asked(step: str, ranks: list[int]) -> bool:
        if go.exists():  # asked again: read once both ranks' all-reduce is over, as a client slower than them would
            _wait_for(lambda: _completed_by(s, step) == set(ranks))
        answers.append(judge(step, ranks))
        go.touch()  # the deadline has passed and the ranks were judged: let them meet
        return answers[-1]

    monkeypatch.setattr(s, "_outside_collectives", asked)
    s.deadline = 3.0
    frame = s.step()
    assert answers[:1] == [True], answers  # past the deadline, both ranks computing outside any collective
    assert frame.hang is None and frame.kinds == set(), frame.hang and frame.hang.message
    assert len(frame.outputs) == 2  # both ranks reached the all-reduce after the deadline had passed
