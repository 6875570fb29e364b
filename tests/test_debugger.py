"""A session is a debugger: the cursor stays at a failed step, a proven deadlock releases only
the calls that can never complete (on gloo too, by default), and goto/rewind replay from the
start on the same engines, saying where the replay departs from the first run.

Real gloo ranks (the shared cluster), real collectives; scenarios are tiny and declared here.
"""

from __future__ import annotations

import os

import pytest
from conftest import TEST_TIMEOUT_S

import workbench as wb
from workbench.errors import WorkbenchError
from workbench.live.session import fingerprints

FLAKY = wb.Scenario("flaky-debugger", probe=None, params={"marker": "", "fail": False})


@FLAKY.step
def setup(ctx) -> None:
    import torch

    ctx.x = torch.ones(4)


@FLAKY.step
def grow_once(ctx) -> None:
    """Grows x, then fails on rank 1 the first time only (a marker file remembers) or whenever ``fail``."""
    import torch.distributed as dist

    ctx.x = ctx.x + 1
    dist.all_reduce(ctx.x)
    if ctx.rank == 1 and (ctx.params["fail"] or not os.path.exists(ctx.params["marker"])):
        open(ctx.params["marker"], "w").close()
        raise RuntimeError("transient failure on rank 1")
    ctx.flaky_ran = True


@FLAKY.step
def report(ctx) -> None:
    if not getattr(ctx, "flaky_ran", False):
        raise RuntimeError("flaky never ran")
    ctx.output("x", ctx.x.clone())


def _x(frame) -> list[float]:
    out = frame.outputs
    return [float(h[0]) for h in out[out["name"] == "x"].sort_values("rank")["head"]]


def _notes(frame) -> str:
    return " | ".join(n for ns in frame.notes.values() for n in ns)


def test_after_a_failed_step_and_recover_the_next_step_reruns_it_and_the_run_ends_clean(healthy, tmp_path):
    s = healthy.session(FLAKY, marker=str(tmp_path / "failed-once"))
    s.step()
    failed = s.step()
    assert failed.kinds == {"error"} and s.next_step == "grow_once"  # the cursor stays at the failed step
    assert "the cursor stays at 'grow_once'" in _notes(failed)
    info = s.recover()
    assert info["replayed"] == ["setup"] and info["cursor"] == "grow_once"
    while not s.done:
        assert s.step().ok
    assert [f.step for f in s.frames] == s.steps and all(f.ok for f in s.frames)
    assert _x(s.frames[-1]) == [4.0, 4.0]  # (1 + 1) summed over 2 ranks: grow ran once on the ranks' state
    assert s.diagnose().clean
    assert [f.step for f in s.log] == ["setup", "grow_once", "setup", "grow_once", "report"]
    assert "after recovery" in _notes(s.frames[1])


def test_a_failed_step_reruns_without_recover_with_the_changed_parameter(healthy, tmp_path):
    s = healthy.session(FLAKY, marker=str(tmp_path / "m"), fail=True)
    s.step()
    assert not s.step().ok and not s.step().ok  # reruns it: fails again while `fail` holds
    assert s.next_step == "grow_once"
    s.params["fail"] = False
    assert s.step().ok and s.step().ok and s.done
    assert _x(s.frames[-1]) == [4.0, 4.0]  # replayed from the start: grew once, not three times
    assert s.log[-3].replayed and "same fingerprints" in _notes(s.log[-3])  # setup replayed, identical


def test_skip_moves_past_a_failed_step_and_says_so(healthy, tmp_path):
    s = healthy.session(FLAKY, marker=str(tmp_path / "m"), fail=True)
    s.run()
    assert s.next_step == "grow_once"  # run() stops at the failed step
    with pytest.raises(WorkbenchError, match="has not run"):
        healthy.session(FLAKY).skip()  # skip() moves past a failed step, not one never run
    skipped = s.skip()
    assert skipped.step == "grow_once" and "skipped by s.skip()" in _notes(skipped)
    assert s.next_step == "report"
    last = s.step()  # rank 1 skips it (its step failed there); rank 0 reports
    assert last.ranks_with("skipped") == {1} and s.done


USER_DEADLOCK = wb.Scenario("finished-peer", probe=None)


@USER_DEADLOCK.step
def prepare(ctx) -> None:
    import torch

    ctx.x = torch.ones(8)


@USER_DEADLOCK.step
def uneven(ctx) -> None:
    """Rank 0 issues one more all-reduce than rank 1: rank 1 returns, rank 0 waits for ever."""
    import torch.distributed as dist

    dist.all_reduce(ctx.x)
    if ctx.rank == 0:
        dist.all_reduce(ctx.x)
    ctx.after = ctx.x.clone()


@USER_DEADLOCK.step
def after(ctx) -> None:
    ctx.output("after", getattr(ctx, "after", ctx.x))  # rank 0 raised before it set `after`


def test_a_gloo_deadlock_is_declared_from_the_ledgers_by_default_and_only_its_call_released(healthy):
    assert healthy.backend == "gloo" and healthy.detect_deadlocks is True  # the default
    s = healthy.session(USER_DEADLOCK)
    s.deadline = 60.0  # neither the deadline nor gloo's 8 s timeout may be what ends it
    frames = s.run()
    hung = frames[1]
    assert hung.hang is not None and hung.hang.caught_by == "ledger deadlock"
    latency = hung.hang.to_dict()["detected_after_s"]
    print(f"gloo deadlock declared {latency:.2f}s after the last rank blocked")
    # declared by the ledgers, before gloo's own 8 s timeout could have ended the call (the figure, about 1 s on a
    # quiet box, is benchmarks/hang_cycles.py's to report, not this test's)
    assert 0 < latency < TEST_TIMEOUT_S, latency
    assert "rank 1 finished the step" in hung.hang.proof
    assert set(hung.released) == {0} and hung.released[0].startswith("all_reduce #2")
    assert set(hung.rank_errors) == {0} and "Timed out" not in hung.rank_errors[0]
    assert "released all_reduce #2" in _notes(hung) and "was not stuck" in " ".join(hung.notes[1])
    # rank 1 finished the step as it would have; the session went on to the last step on both ranks
    assert [f.step for f in frames] == s.steps and len(frames[2].outputs) == 2
    assert all(e != "Timeout" for e in hung.events["error"])


def test_rewind_reproduces_each_steps_fingerprints_and_a_changed_seed_departs(healthy):
    s = healthy.session("fsdp1-rotary-meta-init")
    s.run()
    first = {f.step: f for f in s.frames}
    assert s.done and first["wrap_fsdp1"].hang is not None  # the headline's released broadcast included
    wrap = s.rewind(1)  # back to the state right after wrap_fsdp1, replayed from the start
    assert wrap.step == "wrap_fsdp1" and wrap.replayed and s.next_step == "forward"
    assert s.departures == []
    for name in ("load", "cast", "wrap_fsdp1"):
        again = s.frames[s.steps.index(name)]
        assert again.replayed and fingerprints(again) == fingerprints(first[name]) and fingerprints(again)
    assert "same fingerprints as the earlier run" in _notes(wrap)
    s.params["seed"] = 1  # a different checkpoint: the replay must say it departs
    s.goto("load")
    assert s.departures and s.departures[0]["step"] == "load" and "departs" in _notes(s.frames[0])
    assert s.next_step == "cast"


def test_only_a_call_no_peer_ever_issued_is_declared_at_first_sight():
    from workbench.analysis.collectives import OPEN, ledger_table
    from workbench.analysis.deadlock import find
    from workbench.live.release import certain

    def call(rank, seq, numel=4, state="completed"):
        return {"rank": rank, "session": "s", "attempt": 0, "step": "x", "group": "0", "group_ranks": [0, 1],
                "seq": seq, "op": "broadcast", "dtypes": ["float32"], "shapes": [[numel]], "numel": numel,
                "bytes": numel * 4, "state": state, "t_start": float(seq), "src": 0}

    never = find(ledger_table([call(0, 1), call(1, 1), call(0, 2, state=OPEN)]), done=[1], ranks=[0, 1])
    assert never is not None and certain(never)  # rank 1 is done and never issued #2
    missized = find(ledger_table([call(0, 1, numel=8), call(1, 1, state=OPEN)]), done=[0], ranks=[0, 1])
    assert missized is not None and not certain(missized)  # a pair NCCL may complete silently: hold first
    both = find(ledger_table([call(0, 1, state=OPEN), call(1, 1, numel=8, state=OPEN)]), done=[], ranks=[0, 1])
    assert both is not None and not certain(both)


def test_the_stepper_slider_shows_an_earlier_frame_without_running_and_reruns_to_it(healthy, tmp_path):
    from workbench.live.stepper import Stepper

    st = Stepper(healthy.session(FLAKY, marker=str(tmp_path / "m")))
    st.step()
    st.step()  # grow_once fails on rank 1: the cursor stays there
    s = st.session
    assert len(s.log) == 2 and st.history.max == 1 and "step 1/3" in st.status.value
    st.history.value = 0  # back to the first frame: drawn from the log, nothing runs
    assert "after 'setup'" in st.figure.layout.title.text and len(s.log) == 2 and "setup" in st.shown.value
    assert not st.skip.disabled  # a failed step at the cursor can be skipped
    st.rerun_to_here()  # replay up to 'setup' on the same engines
    assert [f.step for f in s.log] == ["setup", "grow_once", "setup"] and s.log[-1].replayed
    assert s.next_step == "grow_once" and st.history.max == 2
    st.step()  # the marker exists now: grow_once passes
    assert s.frames[-1].ok and s.next_step == "report"


CHECKED = wb.Scenario("check-refuses", probe=None)


@CHECKED.step
def check(ctx) -> None:
    if ctx.rank == 1:
        raise WorkbenchError("the plan differs from rank 0's: refused before sending anything")
    ctx.y = 1


@CHECKED.step
def after_check(ctx) -> None:
    import torch

    ctx.output("rank", torch.tensor([float(ctx.rank)]))


def test_a_check_that_refused_lets_the_cursor_go_on_as_the_ranks_do(healthy):
    s = healthy.session(CHECKED)
    frames = s.run()
    assert [f.step for f in frames] == ["check", "after_check"] and s.done  # not stopped at the refusal
    assert frames[0].rank_errors.keys() == {1} and not frames[0].halted and frames[1].ok
    assert "the session goes on" in " ".join(frames[0].notes[1])
