"""stale-conversion-cache: reused tasks keep sync 1's pipeline-broadcast spec; sync 2 receives into it.

On gloo the mis-sized receive (bf16 [8] = 16 B from the stale spec, the owner sends fp32
[8] = 32 B) aborts the receiving process: the workbench sees a dead engine, the ledger
names the pair of broadcasts, and the cluster comes back with fresh engines. The fix
rebuilds the tasks every sync; the control (bias dtype unchanged) shows why the bug hides.
"""

from __future__ import annotations

import pytest

from workbench.analysis import weightsync_order as wo
from workbench.analysis.collectives import first_divergence

pytestmark = pytest.mark.slow

SCENARIO = "stale-conversion-cache"


def _out(s, step: str, name: str) -> float:
    o = s.outputs
    return float(o[(o["step"] == step) & (o["name"] == name)]["head"].iloc[0][0])


def _notes(s, step: str, rank: int) -> list[str]:
    return next(f for f in s.frames if f.step == step).notes.get(rank, [])


def test_sync1_right_sync2_receives_into_the_stale_bf16_spec_and_the_rank_is_recovered(healthy):
    s = healthy.session(SCENARIO, receiver="workbench")
    s.run()
    assert [f.step for f in s.frames][-1] == "sync_2"
    assert all(f.ok for f in s.frames[:-1])
    assert _out(s, "score_1", "names_wrong") == 0.0 and _out(s, "score_1", "logprob_gap") == 0.0
    assert any("router bias now float32" in n for n in _notes(s, "train_step", 1))
    frame = s.frames[-1]
    assert frame.hang is not None and frame.hang.dead == [0]  # gloo aborts the receiver of the mis-sized broadcast
    div = first_divergence(frame.ledger)
    calls = {r: c for r, c in div.calls.items() if c is not None}
    assert (calls[0]["op"], calls[0]["dtypes"], int(calls[0]["bytes"])) == ("broadcast", "bfloat16", 16)
    assert (calls[1]["op"], calls[1]["dtypes"], int(calls[1]["bytes"])) == ("broadcast", "float32", 32)
    # the reused tasks skipped every spec all-gather in sync 2; sync 1 issued them
    led = s.ledger
    assert (led[led["step"] == "sync_1"]["op"] == "all_gather").any()
    assert not (led[led["step"] == "sync_2"]["op"] == "all_gather").any()
    info = healthy.recover()
    assert info["action"] == "restarted the engines" and info["dead"] == [0]


def test_rebuilding_tasks_per_sync_regathers_the_spec_and_sync2_is_right(healthy):
    s = healthy.session(SCENARIO, receiver="workbench", fix="rebuild-tasks-per-sync")
    s.run()
    assert s.done and all(f.ok for f in s.frames), [f.rank_errors for f in s.frames]
    assert any("cached spec of the router bias: float32" in n for n in _notes(s, "sync_2", 0))
    cyc = wo.sync_cycles({"fix": s.outputs})
    assert cyc["names_wrong"].tolist() == [0, 0] and cyc["logprob_gap"].tolist() == [0.0, 0.0]


def test_control_values_change_but_dtype_does_not_so_the_stale_spec_still_fits(healthy):
    s = healthy.session(SCENARIO, receiver="workbench", bias_dtype_sync2="bfloat16")
    s.run()
    assert s.done and all(f.ok for f in s.frames)
    assert any("reused conversion tasks" in n for n in _notes(s, "sync_2", 0))
    assert _out(s, "score_2", "names_wrong") == 0.0  # the new values arrived: the cache holds specs, not values


def test_reverse_direction_is_silent_on_gloo_and_sync2_loads_a_wrong_bias(healthy):
    """fp32 spec cached, bf16 sent: the receive buffer is the larger one, gloo fills half of it and returns."""
    s = healthy.session(SCENARIO, receiver="workbench", bias_dtype_sync1="float32", bias_dtype_sync2="bfloat16")
    s.run()
    assert s.done and all(f.ok for f in s.frames), [f.rank_errors for f in s.frames]
    assert _out(s, "score_1", "names_wrong") == 0.0
    assert _out(s, "score_2", "names_wrong") == 1.0  # the router bias, and nothing else
    assert any("e_score_correction_bias" in n for n in _notes(s, "score_2", 1))
    sync2 = s.ledger[s.ledger["step"] == "sync_2"]
    div = first_divergence(sync2)
    calls = {r: c for r, c in div.calls.items() if c is not None}
    assert (calls[0]["dtypes"], int(calls[0]["bytes"])) == ("float32", 32)
    assert (calls[1]["dtypes"], int(calls[1]["bytes"])) == ("bfloat16", 16)
    fixed = healthy.session(SCENARIO, receiver="workbench", fix="rebuild-tasks-per-sync", bias_dtype_sync1="float32",
                            bias_dtype_sync2="bfloat16")
    fixed.run()
    assert _out(fixed, "score_2", "names_wrong") == 0.0
