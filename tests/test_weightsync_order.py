"""weight-sync-order-desync: the silent permutation, the drifted mirror's hang, and the fixes.

Unit tests on hand-made plans and streams first (no engines), then the scenario on the
shared 2-rank gloo cluster: stage 1 loads bytes under the wrong names without an error,
stage 2 hangs in an expert all-gather (detected, diagnosed from the ledger, recovered),
``check-streamed-names`` turns stage 1 into one error on both ranks naming the first
mismatching index and both names, and ``one-chunk-plan`` makes both stages right.
"""

from __future__ import annotations

import pytest

from workbench.analysis import weightsync_order as wo
from workbench.analysis.collectives import first_divergence
from workbench.lab.weightsync import broadcast as bc

SCENARIO = "weight-sync-order-desync"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
AFTER_BIAS = "model.layers.1.mlp.shared_experts.gate_proj.weight"


# -- without engines ------------------------------------------------------------------------
PLAN = bc.Plan(["a", "bias", "b", "c"], ["bfloat16", "float32", "bfloat16", "bfloat16"], [[4], [2], [2], [2]])
STREAM = [("a", "bfloat16", [4]), ("b", "bfloat16", [2]), ("c", "bfloat16", [2]), ("bias", "float32", [2])]


def test_check_names_the_first_mismatching_index_and_both_names():
    with pytest.raises(bc.StreamPlanMismatch) as e:
        bc.check_streamed_names(PLAN, STREAM)
    assert (e.value.index, e.value.planned, e.value.streamed) == (1, "bias", "b")
    assert "index 1" in str(e.value) and "'b'" in str(e.value) and "'bias'" in str(e.value)
    bc.check_streamed_names(PLAN, [STREAM[0], STREAM[3], STREAM[1], STREAM[2]])  # same order: passes
    with pytest.raises(bc.StreamPlanMismatch, match="end of stream"):
        bc.check_streamed_names(PLAN, STREAM[:1])
    with pytest.raises(bc.StreamPlanMismatch, match="entry"):  # same name, other dtype: other byte size
        bc.check_streamed_names(PLAN, [STREAM[0], ("bias", "bfloat16", [2])], start=0)


def test_same_totals_same_cuts_so_the_permutation_passes_silently():
    # the producer cuts from the stream, the consumer from the plan: equal totals, equal cuts
    assert sum(PLAN.nbytes(i) for i in range(len(PLAN))) == 8 + 8 + 4 + 4
    assert bc.plan_cuts(PLAN, threshold=1 << 20) == [(0, 4)]
    assert bc.plan_cuts(PLAN, threshold=12) == [(0, 2), (2, 4)]
    with pytest.raises(bc.StreamPlanMismatch) as e:  # the check also compares the cut of each buffer
        bc.check_buffer(PLAN, bc.plan_cuts(PLAN, 12), 0, [STREAM[0], STREAM[1], STREAM[2]])
    assert e.value.index == 1


def test_provenance_says_which_names_got_whose_bytes():
    plan = wo.order_frame([list(e) for e in zip(PLAN.names, PLAN.dtype_names, PLAN.shapes)])
    stream = wo.order_frame([list(e) for e in STREAM])
    assert wo.first_mismatch(plan, stream) == {"index": 1, "planned": "bias", "streamed": "b"}
    pv = wo.provenance(plan, stream).set_index("name")
    assert pv.loc["a", "own"] and not pv.loc["bias", "own"]
    assert pv.loc["bias", "holds"] == "b + c"  # 8 fp32 bytes = the two bf16 tensors after it
    assert pv.loc["b", "holds"] == "bias[0:4 B]" and pv.loc["c", "holds"] == "bias[4:8 B]"
    assert wo.misloaded(plan, stream)[0] == "'bias' (float32) got b + c"


def test_views_mark_the_first_mismatch_and_draw_each_run_per_sync():
    import pandas as pd

    from workbench.viz import cycles_view, match_view, order_view

    plan = wo.order_frame([list(e) for e in zip(PLAN.names, PLAN.dtype_names, PLAN.shapes)])
    stream = wo.order_frame([list(e) for e in STREAM])
    fig = order_view(plan, stream)
    assert "first mismatch at index 1" in fig.layout.annotations[0].text
    assert fig.layout.title.text.startswith("stream vs plan: 3 of 4 names")
    red = [w for tr in fig.data for w in tr.marker.line.width if w > 1]
    assert len(red) == 3  # the plan boxes that got someone else's bytes
    def out(rows):
        return pd.DataFrame([{"step": st, "name": n, "head": [v], "sync": k, "names": 4} for st, n, v, k in rows])

    bug = out([("score", "logprob_gap", 0.13, 1), ("score", "names_wrong", 3.0, 1)])
    fix = out([("score", "logprob_gap", 0.0, 1), ("score", "names_wrong", 0.0, 1),
               ("score_2", "logprob_gap", 0.0, 2), ("score_2", "names_wrong", 0.0, 2)])
    cyc = wo.sync_cycles({"bug": bug, "fix": fix})
    assert cyc[["run", "sync", "names_wrong"]].values.tolist() == [["bug", 1, 3], ["fix", 1, 0], ["fix", 2, 0]]
    assert len(cycles_view({"bug": bug, "fix": fix}).data) == 4
    hist = pd.DataFrame([{"step": st, "name": f"inference.{n}", "ref_diff": d} for st, n, d in
                         [("score", "a", 0.0), ("score", "b", 0.5), ("deliver", "b", 0.5), ("score_2", "b", 0.0)]])
    tab = wo.match_table({"bug": hist})
    assert tab[["sync", "name", "match"]].values.tolist() == [[1, "a", True], [1, "b", False], [2, "b", True]]
    fig = match_view({"bug": hist})
    assert list(fig.data[0].x) == ["bug · sync 1", "bug · sync 2"] and "sync 1: 1 wrong" in fig.layout.title.text


# -- on live ranks --------------------------------------------------------------------------
def _errors(frame) -> dict[int, str]:
    return {int(e.rank): f"{e.error}: {e.message}" for e in frame.events.itertuples()}


def _out(s, step: str, name: str) -> float:
    o = s.outputs
    return float(o[(o["step"] == step) & (o["name"] == name)]["head"].iloc[0][0])


@pytest.mark.slow
def test_stage1_silent_then_stage2_hangs_in_an_expert_all_gather_and_recovers(healthy):
    s = healthy.session(SCENARIO, receiver="workbench")
    s.run(until="score")
    assert all(f.ok for f in s.frames), [f.rank_errors for f in s.frames]  # silent: nothing raised
    assert _out(s, "score", "names_wrong") == 8.0 and _out(s, "score", "logprob_gap") > 0.05
    order = wo.orders(s)
    plan, stream = order[("plan", 1)], order[("stream", 1)]
    assert plan["nbytes"].sum() == stream["nbytes"].sum()  # equal byte totals: no size check can see it
    assert wo.first_mismatch(plan, stream) == {"index": 33, "planned": BIAS, "streamed": AFTER_BIAS}
    pv = wo.provenance(plan, stream).set_index("name")
    assert (~pv["own"]).sum() == 8 and pv.loc[BIAS, "holds"].startswith(AFTER_BIAS)
    found = s.findings()
    ref = found[(found["step"] == "score") & (found["detector"] == "reference")]
    assert f"inference.{BIAS}" in set(ref["name"]) and "logprob_gap" in set(ref["name"])

    s.deadline = 3.0
    frame = s.step()  # mirror_plan: the owner of the bias walks the bucket twice
    hang = frame.hang
    assert frame.step == "mirror_plan" and hang is not None
    assert list(hang.stuck) == [1] and hang.stuck[1].startswith("all_gather_into_tensor")
    assert hang.finished == [0]
    div = hang.divergence
    assert div.kind == "extra" and div.ranks == [1] and div.call["op"] == "all_gather_into_tensor"
    assert div.seq > 200  # after every good call of one full walk
    info = s.recover()
    assert info["action"].startswith("re-formed") and info["replayed"][-1] == "score"
    assert not healthy.needs_recovery


@pytest.mark.slow
def test_check_streamed_names_fails_on_both_ranks_at_the_first_mismatch_before_loading(healthy):
    s = healthy.session(SCENARIO, receiver="workbench", fix="check-streamed-names")
    s.run(until="score")
    deliver = s.frames[3]
    errors = _errors(deliver)
    assert set(errors) == {0, 1} and deliver.hang is None
    for msg in errors.values():
        assert msg.startswith("StreamPlanMismatch") and "index 33" in msg and BIAS in msg and AFTER_BIAS in msg
    assert _out(s, "score", "names_wrong") >= 40  # nothing loaded: the worker still holds its own stale weights


@pytest.mark.slow
def test_one_chunk_plan_with_the_check_syncs_right_twice(healthy):
    s = healthy.session(SCENARIO, receiver="workbench", fix="one-chunk-plan+check-streamed-names")
    s.run()
    assert all(f.ok and f.hang is None for f in s.frames) and s.done
    for step in ("score", "score_2"):
        assert _out(s, step, "names_wrong") == 0.0 and _out(s, step, "logprob_gap") == 0.0
    order = wo.orders(s)
    assert wo.first_mismatch(order[("plan", 2)], order[("stream", 2)]) is None
    assert first_divergence(s.ledger) is None
    cyc = wo.sync_cycles({"fix": s.outputs})
    assert cyc["sync"].tolist() == [1, 2] and cyc["names_wrong"].tolist() == [0, 0]
