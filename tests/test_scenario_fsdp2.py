"""FSDP2 full-state-dict load on 2 real gloo ranks: inv_freq never synced, or synced from garbage.

Without poison (what ``to_empty`` really leaves on CPU): never-synced rank 1 gets recycled
memory in ``inv_freq`` (zeros, finite garbage, at times a NaN), so its logits are silently
off or NaN while rank 0 matches the reference; rank0-garbage gives both ranks the same
stale bytes, so the ranks agree (same logits fingerprint) and only the reference check
and the trace's reference comparison see it.
"""

from __future__ import annotations

import pytest

from workbench.analysis.findings import status
from workbench.analysis.trace import first_fault

SCENARIO = "fsdp2-nonpersistent-buffer-sync"
INV = "model.model.rotary_emb.inv_freq"
ROTARY = "model.rotary_emb"
_RUNS: dict = {}


@pytest.fixture(scope="module")
def run(cluster):
    def get(variant: str, fix: str | None = None, poison: bool = True):
        key = (variant, fix, poison)
        if key not in _RUNS:
            s = cluster.session(SCENARIO, fix=fix, poison=poison, variant=variant)
            s.run()
            assert all(f.ok for f in s.frames), [f.rank_errors for f in s.frames]
            _RUNS[key] = s
        return _RUNS[key]
    yield get
    _RUNS.clear()


def inv(s, rank: int) -> dict:
    h = s.frames[-1].tensors
    hit = h[(h["rank"] == rank) & (h["name"] == INV)]
    assert len(hit) == 1
    return hit.iloc[0].to_dict()


def logits(s) -> dict:
    return s.frames[-1].outputs.set_index("rank").to_dict(orient="index")


def trace_findings(s):
    f = s.record().findings()
    return f[f["detector"] == "forward trace"]


def test_phases_and_bad_variant(cluster):
    s = cluster.session(SCENARIO, variant="nope")
    assert s.steps == ["load", "shard", "materialize", "load_state_dict", "sync_buffers", "forward"]
    frame = s.step()
    assert set(frame.rank_errors) == {0, 1} and "variant must be one of" in frame.rank_errors[0]


def test_never_synced_with_poison_rank1_inv_freq_never_written_logits_nan(run):
    s = run("never-synced")
    assert inv(s, 0)["poisoned"] == 0 and inv(s, 0)["head"][0] == 1.0
    assert inv(s, 1)["poisoned"] == inv(s, 1)["numel"] == 32
    out = logits(s)
    assert out[0]["nan"] == 0 and out[0]["ref_max_abs_diff"] == 0.0
    assert out[1]["nan"] == out[1]["numel"]
    assert first_fault(s.trace, 1) == ROTARY and first_fault(s.trace, 0) is None
    (msg,) = trace_findings(s)["finding"]
    assert msg.startswith(f"rank 1: first non-finite output at `{ROTARY}`")
    # the parameters came through the state dict: only the non-persistent buffers are bad
    st = status(s.frames[-1].tensors)
    assert set(st[st["status"] == "poison"]["name"]) == {INV, "model.model.rotary_emb.original_inv_freq"}


def test_never_synced_without_poison_rank1_silently_off(run):
    s = run("never-synced", poison=False)
    assert inv(s, 1)["poisoned"] == 0
    assert inv(s, 1)["fingerprint"] != inv(s, 0)["fingerprint"]
    out = logits(s)
    assert out[0]["ref_max_abs_diff"] == 0.0
    assert out[1]["ref_max_abs_diff"] > 1e-2  # NaN logits count as inf
    assert first_fault(s.trace, 1) == ROTARY and first_fault(s.trace, 0) is None


@pytest.mark.parametrize("poison", [True, False])
def test_rank0_garbage_every_rank_agrees_only_the_reference_disagrees(run, poison):
    s = run("rank0-garbage", poison=poison)
    r0, r1 = inv(s, 0), inv(s, 1)
    assert r0["fingerprint"] == r1["fingerprint"]  # a cross-rank check sees nothing
    assert r0["head"][0] != 1.0  # the config implies inv_freq[0] == 1.0
    out = logits(s)
    assert out[0]["fingerprint"] == out[1]["fingerprint"]
    assert out[0]["ref_max_abs_diff"] > 1e-2 and out[1]["ref_max_abs_diff"] > 1e-2
    found = trace_findings(s)
    assert set(found["rank"]) == {0, 1} and set(found["name"]) == {ROTARY}
    assert not found["finding"].str.contains("from rank 0").any()
    if poison:
        assert r0["poisoned"] == r1["poisoned"] == 32


@pytest.mark.parametrize("variant,poison", [("never-synced", True), ("rank0-garbage", True),
                                            ("rank0-garbage", False)])
def test_init_buffers_before_broadcast_fixes_both_variants(run, variant, poison):
    s = run(variant, "init-buffers-before-broadcast", poison)
    assert inv(s, 0)["head"][0] == inv(s, 1)["head"][0] == 1.0
    assert inv(s, 0)["fingerprint"] == inv(s, 1)["fingerprint"]
    st = status(s.frames[-1].tensors)
    bad = st[st["status"].isin(["poison", "nan", "inf"])]
    assert bad.empty, bad[["rank", "name", "status", "detail"]].to_string()  # which tensor, if it ever shows
    out = logits(s)
    assert out[0]["nan"] == out[1]["nan"] == 0
    assert out[0]["ref_max_abs_diff"] == out[1]["ref_max_abs_diff"] == 0.0
    assert trace_findings(s).empty


def test_state_dict_then_sync_fixes_never_synced_but_not_rank0_garbage(run):
    fixed = run("never-synced", "state-dict-then-sync")
    assert inv(fixed, 1)["fingerprint"] == inv(fixed, 0)["fingerprint"] and inv(fixed, 1)["poisoned"] == 0
    assert all(o["ref_max_abs_diff"] == 0.0 for o in logits(fixed).values())
    assert trace_findings(fixed).empty
    still = run("rank0-garbage", "state-dict-then-sync")
    assert inv(still, 0)["poisoned"] == inv(still, 1)["poisoned"] == 32
    assert all(o["nan"] == o["numel"] for o in logits(still).values())
