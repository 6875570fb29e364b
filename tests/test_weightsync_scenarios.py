"""The two colocated weight-sync scenarios on 2 real gloo ranks: the bug shows, the fix removes it.

Roles: rank r is trainer rank r and hosts inference worker (r-1) % 2, so worker 1 (the one
rank 0's metadata is wrong for) lives on rank 0. Bound for "the fix removes it": the mean
and max |log-prob - trainer's| of the fixed tokens below 1e-3 (the output detector's
threshold); on CPU a right sync leaves the same bf16 bytes, so it is 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from workbench import viz
from workbench.analysis import weightsync as ws
from workbench.lab.weightsync import ipc
from workbench.postmortem import bundle
from workbench.scenarios import weight_sync_rank0_metadata as colocated

GAP_BOUND = 1e-3
EXP = "model.layers.0.mlp.experts"
BIAS = "model.layers.0.mlp.gate.e_score_correction_bias"


def run(cluster, name, fix=None, **params):
    s = cluster.session(name, fix=fix, **{"receiver": "workbench", **params})
    s.run()
    assert all(f.ok for f in s.frames), [f.rank_errors for f in s.frames]
    rec = s.record()
    s.reset()
    return rec


@pytest.fixture(scope="module")
def metadata_runs(cluster):
    return {"bug": run(cluster, "weight-sync-rank0-metadata"),
            "fix": run(cluster, "weight-sync-rank0-metadata", "per-rank-metadata"),
            "control": run(cluster, "weight-sync-rank0-metadata", layout="replicated")}


@pytest.fixture(scope="module")
def bias_runs(cluster):
    return {"bug": run(cluster, "router-bias-bf16"),
            "fix": run(cluster, "router-bias-bf16", "keep-fp32-routing-params")}


def gaps(rec) -> dict[int, dict]:
    return {int(r["worker"]): r for r in ws.output_gap(rec).to_dict(orient="records")}


def test_rank0_metadata_loads_rank1_experts_under_rank0_names_on_worker_1(metadata_runs):
    bug = metadata_runs["bug"]
    assert ws.workers(bug) == {0: 1, 1: 0}
    m = ws.match_matrix(bug)
    w0, w1 = m[m["worker"] == 0], m[m["worker"] == 1]
    assert (w0["status"] == "match").all() and len(w0) == 23  # rank 0's metadata is right for rank 0's buffer
    mis = w1[w1["status"] == "mislabel"].set_index("name")
    assert len(mis) == 8 and set(mis["holds_rank"]) == {1}
    for e in range(4):  # worker 1's expert e name holds trainer rank 1's expert e + 4
        for w in ("gate_up_proj", "down_proj"):
            assert mis.loc[f"{EXP}.{e}.{w}", "holds_name"] == f"{EXP}.{e + 4}.{w}"
    assert set(w1[w1["status"] == "stale"]["name"]) == {f"{EXP}.{e}.{w}" for e in range(4, 8)
                                                         for w in ("gate_up_proj", "down_proj")}
    assert ws.mislabels(bug)[0] == f"worker 1 `{EXP}.0.gate_up_proj` holds trainer rank 1's `{EXP}.4.gate_up_proj`"
    g = gaps(bug)
    assert g[1]["after"] > 0.3 and g[1]["after"] > 3 * g[1]["before"]  # the sync made worker 1 worse
    assert g[0]["after"] < GAP_BOUND
    assert bug.events.empty  # nothing raised anywhere
    f = bug.findings()
    last = f[(f["step"] == "check") & (f["severity"] == "error")]
    assert set(last["rank"].dropna()) == {0}  # only rank 0 (worker 1's host) is in error at the end


def test_per_rank_metadata_and_the_identical_layout_control_are_clean(metadata_runs):
    for key in ("fix", "control"):
        rec = metadata_runs[key]
        m = ws.match_matrix(rec)
        assert (m["status"] == "match").all() and len(m) == (46 if key == "fix" else 62), key
        for g in gaps(rec).values():
            assert g["before"] > 0.05 and g["after"] < GAP_BOUND and g["after_max"] < GAP_BOUND, key
        f = rec.findings()
        assert f[(f["step"] == "check") & (f["severity"] == "error")].empty, key
    assert ws.findings(metadata_runs["bug"])["finding"].str.contains("mislabel").any()
    assert ws.findings(metadata_runs["control"]).empty  # rank 0's metadata fits every rank: silent


def test_bf16_router_bias_collapses_and_routing_changes(bias_runs):
    bug = bias_runs["bug"]
    s = ws.routing_summary(bug)
    assert (s["distinct_bias_trainer"] == 8).all() and (s["distinct_bias_synced"] <= 2).all()
    assert (s["changed_fraction"] > 0.2).all()
    m = ws.match_matrix(bug)
    cast = m[m["status"] == "cast"]
    assert list(cast["name"]) == [BIAS, BIAS] and set(cast["sent_dtype"]) == {"bfloat16"}
    assert (m[m["name"] != BIAS]["status"] == "match").all()
    for g in gaps(bug).values():
        assert g["after_max"] > GAP_BOUND and g["after"] > 0.05
    assert set(ws.routing(bug).groupby("worker")["changed"].any()) == {True}


def test_keeping_routing_params_fp32_packs_per_dtype_and_restores_routing(bias_runs):
    fix = bias_runs["fix"]
    s = ws.routing_summary(fix)
    assert (s["distinct_bias_synced"] == 8).all() and (s["changed_fraction"] == 0).all()
    assert (ws.match_matrix(fix)["status"] == "match").all()
    for g in gaps(fix).values():
        assert g["after"] < GAP_BOUND and g["after_max"] < GAP_BOUND
    packed = [n["note"] for n in fix.notes if n["step"] == "pack"]
    assert all("2 buffer(s)" in n and "x bfloat16, 8 x float32" in n for n in packed) and len(packed) == 2
    assert all("1 buffer(s)" in n["note"] for n in bias_runs["bug"].notes if n["step"] == "pack")


def test_recorded_bundles_name_the_mislabel_and_render_the_views():
    """No engines: the same analysis and views on the recorded CPU bundles."""
    root = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"
    meta = bundle.load(root / "weight-sync-rank0-metadata.wbundle")
    bug, fix = meta.records
    assert ws.mislabels(bug)[0] == f"worker 1 `{EXP}.0.gate_up_proj` holds trainer rank 1's `{EXP}.4.gate_up_proj`"
    assert ws.mislabels(fix) == []
    fig = viz.match_matrix_view(bug)
    assert fig.layout.title.text.startswith("Sender -> receiver match matrix: 16 of 54 names")
    w0 = list(fig.data[0].z[0])  # worker 0: its 23 names match, the 8 experts it does not host are blank
    assert w0.count(0) == 23 and w0.count(None) == 8
    lay = ws.buffer_layout(bug).set_index(["rank", "dtype", "name"])["loaded_as"]
    assert lay[(1, "bfloat16", f"{EXP}.4.gate_up_proj")] == f"{EXP}.0.gate_up_proj"  # bytes of e4 cut as e0
    assert lay[(0, "bfloat16", f"{EXP}.0.gate_up_proj")] == f"{EXP}.0.gate_up_proj"
    assert len(viz.buffer_layout_view(bug).data) == 4  # 2 ranks x (bytes, names loaded as)
    gap = viz.output_gap_view(bug, fix)
    assert len(gap.data) == 2 and len(gap.data[0].y) == 4
    bias = bundle.load(root / "router-bias-bf16.wbundle")
    rv = viz.routing_view(bias.records[0], worker=1)
    assert "of tokens change expert set" in rv.layout.title.text and len(rv.data[0].z) == 32
    assert not ws.routing(bias.records[1])["changed"].any()


# -- bad input through a session: one line naming the tensor, ranks stay usable -------------------
bad = wb.Scenario("weight-sync-bad-input", params={**colocated.SCENARIO.params, "corrupt": "handle"})


@bad.step
def build(ctx):
    colocated.build(ctx)


@bad.step
def pack(ctx):
    colocated.pack(ctx, ())


@bad.step
def share(ctx):
    colocated.share(ctx, per_rank=True)


@bad.step
def corrupt(ctx):
    req = ctx.requests[0]
    key = ipc.device_key(ctx.worker_device, ctx.worker)
    meta = dict(req.per_device[key])
    how = ctx.params["corrupt"]
    if how == "handle":
        h = req.handles[key]
        req.handles[key] = ipc.Handle(h.device, b"\x80\x05garbage", h.numel, h.dtype_name, h.first_name)
    elif how == "sizes":
        meta["sizes"] = [*meta["sizes"][:-1], meta["sizes"][-1] - 1]
        meta["shapes"] = [*meta["shapes"][:-1], [meta["sizes"][-1]]]
    elif how == "name":
        meta["names"] = [f"{EXP}.99.gate_up_proj", *meta["names"][1:]]
    req.per_device[key] = meta


@bad.step
def load(ctx):
    colocated.load(ctx)


@pytest.mark.parametrize("corrupt, message", [
    ("handle", "cannot rebuild the IPC handle of the cpu buffer starting with tensor '{first}'"),
    ("sizes", "metadata sizes add up to 19063 elements but the buffer holds 19064 (metadata ends with tensor "
              "'lm_head.weight')"),
    ("name", f"the receiver's model has no tensor '{EXP}.99.gate_up_proj'"),
])
def test_bad_input_is_one_line_naming_the_tensor(healthy, corrupt, message):
    s = healthy.session(bad, corrupt=corrupt, receiver="workbench")
    s.run()
    frame = s.frames[-1]
    assert frame.step == "load" and set(frame.rank_errors) == {0, 1}
    first = {0: f"{EXP}.4.gate_up_proj", 1: f"{EXP}.0.gate_up_proj"}  # worker 1 on rank 0 reads rank 1's buffer
    for rank, text in frame.rank_errors.items():
        assert "\n" not in text and message.format(first=first[rank]) in text, text
    s.reset()
    assert s.step().step == "build" and healthy.alive and not healthy.dead_ranks()


def test_unknown_layout_is_one_line(healthy):
    s = healthy.session("weight-sync-rank0-metadata", layout="pp", receiver="workbench")
    s.run()
    errs = s.frames[0].rank_errors
    assert set(errs) == {0, 1} and all("unknown export layout 'pp'; valid: ep, replicated" in e for e in errs.values())
    assert all("\n" not in e for e in errs.values())
