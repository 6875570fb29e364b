"""The live status line of a long step: worded from hand-made ledgers, drawn by the sinks, and fired
by a real 2-rank hang; the hang's proof and stacks in the report."""

from __future__ import annotations

import io

import pandas as pd
import pytest

from workbench.analysis.collectives import OPEN, ledger_table
from workbench.analysis.progress import short_dtypes, status_line
from workbench.live import progress as live

T0 = 1000.0  # the step started here (wall clock, as the ranks stamp their rows)


def call(rank, seq, op="broadcast", dtype="bfloat16", numel=426944, state="completed", t=T0 + 0.1, **kw):
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return {"rank": rank, "session": "s", "attempt": 0, "step": "x", "group": "0", "group_ranks": [0, 1],
            "seq": seq, "op": op, "dtypes": [dtype], "shapes": [[numel]], "numel": numel, "bytes": numel * size,
            "state": state, "t_start": t, **kw}


def test_a_done_rank_and_a_rank_waiting_in_a_collective():
    led = ledger_table([call(0, 1, op="broadcast", dtype="float32", numel=64),
                        call(1, 1, state=OPEN, t=T0 + 0.3)])
    line = status_line(led, [0, 1], done={0: 0.42}, now=T0 + 7.5, started=T0)
    assert line == "rank 0 done 0.4 s · rank 1 in broadcast #1 bf16 833.9 KiB for 7.2 s"


def test_a_rank_between_collectives_is_running_and_the_earliest_open_call_is_where_it_waits():
    led = ledger_table([call(0, 1), call(0, 2, op="all_reduce", dtype="float32", numel=4, state=OPEN, t=T0 + 2.0),
                        call(0, 3, op="all_gather_into_tensor", state=OPEN, t=T0 + 2.5),  # queued behind #2
                        call(1, 1)])
    line = status_line(led, [1, 0], done={}, now=T0 + 3.1, started=T0)
    assert line == "rank 0 in all_reduce #2 fp32 16 B for 1.1 s · rank 1 running 3.1 s"


def test_no_ledger_yet_and_other_groups():
    assert status_line(ledger_table([]), [0, 1], {}, T0 + 1.25, T0) == "rank 0 running 1.2 s · rank 1 running 1.2 s"
    led = ledger_table([call(0, 5, op="all_gather_into_tensor", state=OPEN, group="1", t=T0 + 1)])
    assert status_line(led, [0], {}, T0 + 2, T0) == \
        "rank 0 in all_gather_into_tensor #5 bf16 833.9 KiB on group 1 for 1.0 s"
    assert short_dtypes("bfloat16,float32,int64") == "bf16,fp32,int64" and short_dtypes(None) == ""


def test_the_step_line_waits_a_second_then_draws_and_clears():
    shown: list[str] = []
    led = ledger_table([call(1, 1, state=OPEN, t=T0)])
    line = live.StepLine(shown.append, [0, 1], read=lambda: led, after=0.0, every=0.0)
    line({0})
    assert len(shown) == 1 and shown[0].startswith("rank 0 done 0.0 s · rank 1 in broadcast #1 bf16 833.9 KiB for ")
    line.close()
    assert shown[-1] == ""  # the step ended: cleared
    quiet: list[str] = []
    fast = live.StepLine(quiet.append, [0, 1], read=lambda: led, after=60.0)
    fast(set())
    fast.close()
    assert quiet == []  # a step quicker than `after` shows nothing, not even a clear


def test_a_failing_sink_is_dropped_and_the_watch_still_polled():
    def broken(text):
        raise RuntimeError("no display")

    line = live.StepLine(broken, [0], read=lambda: [], after=0.0, every=0.0)
    polled = []
    poll = live.poll_with(line, lambda done: polled.append(done) or "proof")
    assert poll({0}) == "proof" and line.sink is None  # the step goes on, without the line
    assert poll({0}) == "proof" and len(polled) == 2
    assert live.poll_with(None, None) is None  # nothing to poll: the engines wait as before


def test_the_reader_raw_rows_word_the_same_line_as_the_table():
    """The live line reads raw open rows (no table of every call); both give one line."""
    rows = [call(0, 1, op="broadcast", dtype="float32", numel=64),
            {**call(1, 1, state=OPEN, t=T0 + 0.3), "group": 0}]  # as the reader holds them: lists, int group
    line = "rank 0 done 0.4 s · rank 1 in broadcast #1 bf16 833.9 KiB for 7.2 s"
    assert status_line(rows, [0, 1], {0: 0.42}, T0 + 7.5, T0) == line
    assert status_line(ledger_table(rows), [0, 1], {0: 0.42}, T0 + 7.5, T0) == line


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_terminal_line_rewrites_in_place_and_ci_logs_get_a_plain_line_now_and_then():
    tty = _Stream(True)
    sink = live.TerminalLine(tty)
    sink("rank 0 running 1.0 s")
    sink("rank 0 running 1.3 s")
    sink("")
    assert tty.getvalue() == "\rrank 0 running 1.0 s\x1b[K\rrank 0 running 1.3 s\x1b[K\r\x1b[K"
    log = _Stream(False)
    sink = live.TerminalLine(log, plain_every=0.0)
    sink("rank 0 running 1.0 s")
    sink("")
    assert log.getvalue() == "workbench: rank 0 running 1.0 s\n"  # no escape codes, nothing to clear
    quiet = _Stream(False)
    sink = live.TerminalLine(quiet, plain_every=60.0)
    for _ in range(5):
        sink("rank 0 running 1.0 s")
    assert quiet.getvalue() == ""  # not every poll: at most one line per `plain_every`


def test_progress_setting_picks_the_sink():
    assert live.sink_for(False) is None and live.sink_for(None) is None
    assert live.sink_for(print) is print
    assert isinstance(live.sink_for(True), live.TerminalLine)  # no kernel here


@pytest.mark.slow
def test_real_hang_shows_the_waiting_collective_live_and_the_report_its_proof_and_stacks(healthy, monkeypatch,
                                                                                      tmp_path):
    from workbench.postmortem import bundle, report

    # the status line from the first poll, at every poll: the hang is declared 0.3 s after both ranks block
    monkeypatch.setattr(live, "AFTER_S", 0.0)
    monkeypatch.setattr(live, "EVERY_S", 0.0)
    assert healthy.detect_deadlocks  # declared from the ledgers (the default on gloo too)
    shown: list[str] = []
    try:
        s = healthy.session("eval-loop-uneven-batches")
        s.progress = shown.append
        s.deadline = 60.0
        s.run()
        hang = s.hangs[0].hang
        assert hang.caught_by == "ledger deadlock"
        lines = [x for x in shown if x]
        # the deadlock watch saw both ranks in their open calls for 0.3 s; the line was drawn at each of those polls
        assert any("rank 0 in all_reduce #9 fp32" in x and "rank 1 in all_gather_into_tensor #9 fp32" in x
                   for x in lines), lines[-3:]
        assert shown[-1] == ""  # cleared when the step ended
        live_page = report.render(s.records())
        loaded_page = report.render(bundle.load(s.save(tmp_path / "hang.wbundle")))
        for page in (live_page, loaded_page):
            assert "cannot pair" in page and "all_gather_into_tensor #9" in page  # the proof
            assert "in evaluate" in page and "in all_reduce" in page  # a stuck rank's frames
        assert healthy.recover()["action"].startswith("re-formed")
    finally:
        healthy.detect_deadlocks = True


SITE = "/venv/lib/python3.11/site-packages"
DUMP = "\n".join([
    "Current thread 0x00007fa963c66b80 (most recent call first):",
    f'  File "{SITE}/torch/distributed/distributed_c10d.py", line 4394 in all_gather_single',
    f'  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper',
    *[f'  File "{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line {i} in foreach_all_gather'
      for i in range(9)],
    '  File "/src/workbench/scenarios/eval_loop_uneven_batches.py", line 95 in evaluate',
    '  File "/src/workbench/rank/remote.py", line 62 in run_step',
    '  File "<string>", line 1 in <module>',
]) + "\n\nThread 0x00007fa94bfff6c0 (most recent call first):\n  File \"/x/threading.py\", line 1 in wait\n"
HANG = {"step": "evaluate", "message": "step 'evaluate': deadlocked, read from the ledgers before any timeout\n"
        "  rank 1: inside all_gather_into_tensor #9", "proof": "the open calls on group 0 cannot pair: ...",
        "stuck": {"1": "all_gather_into_tensor #9 float32 [73920] 288.8 KiB"}, "stacks": {"1": DUMP},
        "divergence": None}


def test_a_stuck_rank_shows_its_innermost_frames_and_the_steps_own_line():
    from workbench.analysis import stacks

    text = stacks.innermost(DUMP, n=3)
    assert text.splitlines() == [
        "Current thread 0x00007fa963c66b80 (most recent call first):",
        "  torch/distributed/distributed_c10d.py:4394 in all_gather_single",
        "  torch/distributed/c10d_logger.py:83 in wrapper",
        "  torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:0 in foreach_all_gather",
        "  … 8 frame(s)",
        "  workbench/scenarios/eval_loop_uneven_batches.py:95 in evaluate",  # the step, however deep the library
        "  … 2 outer frame(s)"]
    assert "threading.py" not in stacks.main_thread(DUMP)  # the engine's other threads stay out
    assert stacks.innermost("") == "" and stacks.stuck_ranks({"stuck": {}, "stacks": {}}) == []
    # a bundle scrubs machine paths to placeholders; the step's frame is still told from a library's
    assert stacks.is_user_frame('  File "<workbench>/workbench/scenarios/eval_loop.py", line 95 in evaluate')
    assert not stacks.is_user_frame('  File "<site-packages>/torch/nn/modules/module.py", line 1 in _call_impl')
    assert not stacks.is_user_frame('  File "<workbench>/workbench/rank/remote.py", line 62 in run_step')
    assert not stacks.is_user_frame('  File "<string>", line 1 in <module>')


def test_the_hang_view_and_the_report_show_the_proof_and_each_stuck_ranks_stack():
    from workbench.postmortem import report
    from workbench.postmortem.record import RunRecord
    from workbench.viz import hang_view

    fig = hang_view(HANG)
    assert "proof: the open calls on group 0 cannot pair" in fig.layout.title.text
    assert list(fig.data[0].cells.values[0]) == ["rank 1"] and "in evaluate" in fig.data[0].cells.values[2][0]
    empty = pd.DataFrame()
    rec = RunRecord({"scenario": "eval-loop-uneven-batches", "steps_run": ["evaluate"], "hangs": [HANG]},
                    empty, empty, empty)
    page = report.render([rec])
    section = page[page.index("Hang in step"):]
    assert "<b>proof</b>: the open calls on group 0 cannot pair" in section
    assert "<summary>rank 1: waits in all_gather_into_tensor #9" in section
    assert "eval_loop_uneven_batches.py:95 in evaluate" in section and "whole main thread" in section


def test_the_stepper_shows_the_line_in_its_own_widget():
    """A button's step has no cell output to draw into: the stepper gives its session a widget line."""
    from workbench.live.session import Session
    from workbench.live.stepper import Stepper

    st = Stepper(Session(None, "eval-loop-uneven-batches"))  # no step runs: no ranks needed
    st.session.progress("rank 0 done 0.4 s · rank 1 in broadcast #1 bf16 833.9 KiB for 7.2 s")
    assert st.progress.value == "<code>rank 0 done 0.4 s · rank 1 in broadcast #1 bf16 833.9 KiB for 7.2 s</code>"
    st.session.progress("")
    assert st.progress.value == ""
    st.session.close()
    own = Stepper(Session(None, "eval-loop-uneven-batches", progress=False))
    assert own.session.progress is False  # a session's own setting wins
    own.session.close()
