"""to_empty(recurse=False) clobbers the router's expert_bias on 2 real gloo ranks; meta-only fixes it.

Without poison, ``to_empty`` hands the 8-float bias whatever the allocator had: stale
bytes (huge values, -0.0, at times plain zeros) that differ run to run and rank to rank.
Where they are large, every token goes to one expert on that rank; where they happen to
be zeros the bug is invisible on that rank. The tests say which of those they rely on.
"""

from __future__ import annotations

import pytest

from workbench.analysis.findings import status
from workbench.analysis.trace import first_fault

SCENARIO = "to-empty-clobbers-buffers"
BIAS = "model.router.expert_bias"


def bias(frame, rank: int) -> dict:
    t = frame.tensors
    hit = t[(t["rank"] == rank) & (t["name"] == BIAS)]
    assert len(hit) == 1
    return hit.iloc[0].to_dict()


def output(s, rank: int, name: str, step: str = "route") -> dict:
    o = s.frames[s.steps.index(step)].outputs
    return o[(o["rank"] == rank) & (o["name"] == name)].iloc[0].to_dict()


@pytest.fixture(scope="module")
def bug(cluster):
    s = cluster.session(SCENARIO)
    s.run()
    assert all(f.ok for f in s.frames), [f.rank_errors for f in s.frames]
    return s


def test_bias_escapes_meta_then_to_empty_poisons_it(bug):
    build, mat = bug.frames[0], bug.frames[1]
    assert bug.steps == ["build", "materialize", "route", "train"]
    for rank in (0, 1):
        b = bias(build, rank)
        assert not b["is_meta"] and b["head"] == [0.0] * 8
        assert build.tensors[(build.tensors["rank"] == rank) & (build.tensors["name"] != BIAS)]["is_meta"].all()
        assert bias(mat, rank)["poisoned"] == 8  # never written since to_empty
    # reset_parameters wrote every parameter: the bias is the only never-written tensor
    st = status(mat.tensors)
    assert set(st[st["status"] != "ok"]["name"]) == {BIAS}


def test_routing_collapses_and_detectors_name_the_router(bug):
    for rank in (0, 1):
        load = output(bug, rank, "expert_load")
        assert sorted(load["head"], reverse=True)[:2] == [256.0, 256.0]  # top-2: every token, same 2 experts
        assert load["ref_max_abs_diff"] > 100
        assert output(bug, rank, "hidden")["nan"] == 0  # gates come from unbiased scores: nothing crashes
        assert first_fault(bug.trace, rank) == "router"
    f = bug.record().findings()
    tr = f[f["detector"] == "forward trace"]
    assert set(tr["rank"]) == {0, 1} and tr["finding"].str.contains("departing from the reference at `router`").all()


def test_training_keeps_the_bias_nan_and_the_diagnosis_says_it_was_real_then_replaced(bug):
    """The report's consequence: the balancing update adds to the bias, so NaN stays NaN for the whole run."""
    for rank in (0, 1):
        trained = output(bug, rank, "expert_bias_after_training", step="train")
        assert trained["nan"] == 8 and trained["ref_max_abs_diff"] == float("inf")
    d = bug.diagnose()
    assert d.mechanism == "never-written" and d.step == "materialize"
    assert "was real (not meta) before step `materialize`" in d.sentence
    assert "replaced there by memory never written since" in d.sentence
    assert "kept it NaN through step `train`" in d.sentence


@pytest.mark.parametrize("poison", [True, False])
def test_meta_only_materialization_keeps_the_zeros_and_balanced_load(cluster, poison):
    s = cluster.session(SCENARIO, fix="materialize-meta-only", poison=poison)
    s.run()
    assert all(f.ok for f in s.frames)
    for rank in (0, 1):
        b = bias(s.frames[2], rank)
        assert b["head"] == [0.0] * 8 and b["poisoned"] == 0 and b["raw"] == "00" * 32
        trained = output(s, rank, "expert_bias_after_training", step="train")
        assert trained["nan"] == 0 and trained["ref_max_abs_diff"] == 0.0 and any(trained["head"])  # balancing moved it
        load = output(s, rank, "expert_load")
        assert load["ref_max_abs_diff"] == 0.0 and max(load["head"]) < 128
    assert (status(s.frames[-1].tensors)["status"] == "ok").all()
    assert output(s, 0, "global_expert_load")["head"] == [2 * v for v in output(s, 0, "expert_load")["head"]]
    assert s.diagnose().mechanism == "clean"
    f = s.record().findings()
    assert f[f["detector"] == "forward trace"].empty


def test_without_poison_the_bias_is_stale_memory_and_where_it_bites_the_trace_names_the_router(cluster):
    """Stale bytes come and go: three runs, at least one rank of one run holds nonzero bytes."""
    stale = 0
    for _ in range(3):
        s = cluster.session(SCENARIO, poison=False)
        s.run()
        for rank in (0, 1):
            b = bias(s.frames[-1], rank)
            assert b["poisoned"] == 0
            stale += b["raw"] != "00" * 32
            if output(s, rank, "expert_load")["ref_max_abs_diff"] > 0:
                assert first_fault(s.trace, rank) == "router"
    assert stale >= 1, "to_empty gave zeros on every rank three times: the bug was invisible without poison"
