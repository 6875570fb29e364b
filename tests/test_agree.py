"""Right code reads clean: what must agree across ranks is learned from the job's parallelism (issues 51, 48).

Real torchrun jobs on gloo (2 CPU ranks; HSDP on 4): DDP with per-rank batches, expert parallel with plain
tensors (each rank its own experts, a replicated router), tensor parallel, HSDP 2 x 2; each layout also with
one real divergence, which the diagnosis names; then a live data-parallel step on the shared cluster. Without
engines: the status a row gets from its ``agree`` columns, and records without them keep today's rule.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jobrun
import pandas as pd
import pytest
import torch
import torch.distributed as dist
from conftest import ready
from torch import nn

import workbench as wb
from workbench.analysis import findings

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "parallel_layouts_job.py"


def _torchrun(out: Path, ranks: int, *modes: str) -> dict[str, wb.Bundle]:

    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_CAPTURE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = jobrun.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                      str(ranks), str(JOB), str(out), *modes], out, timeout=600, env=env, cwd=out.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {m: wb.load(out / m) for m in modes}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict[str, wb.Bundle]:
    return _torchrun(tmp_path_factory.mktemp("layouts") / "runs", 2, "ddp", "ddp-changed", "ddp-loss-world", "ep",
                     "ep-router", "tp")


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict[str, wb.Bundle]:
    return _torchrun(tmp_path_factory.mktemp("hsdp") / "runs", 4, "hsdp", "hsdp-seed-per-shard", "hsdp-broadcast")


def _clean(b: wb.Bundle) -> None:
    assert b.problems == []
    d = b.bug.diagnose()
    assert d.clean, d.sentence
    found = b.bug.findings()
    assert found[found["detector"].str.startswith("status") | (found["detector"] == "outputs")].empty, found


def test_a_ddp_job_with_per_rank_batches_reads_clean(two):
    """Each rank seeds its own init (DDP's broadcast makes them one) and trains on its own batches: logits and loss
    differ by design, the parameters agree (a DDP replica, and broadcast at wrap)."""
    _clean(two["ddp"])
    t = two["ddp"].bug.tensors
    assert set(t["agree"]) == {"0,1"} and set(t["agree_by"]) == {"DDP replica"}
    o = two["ddp"].bug.outputs
    assert set(o["agree"]) == {""} and o.groupby(["step", "name"])["fingerprint"].nunique().min() == 2  # they differ
    st = findings.status(two["ddp"].bug.tensors.query("step == 'step0'").drop(columns=["step", "step_index"]))
    assert set(st["status"]) == {"ok"}


def test_a_ddp_rank_changed_after_the_broadcast_is_named(two):
    d = two["ddp-changed"].bug.diagnose()
    assert d.mechanism == "diverged" and d.ranks == [1] and d.tensor == "model.module.2.weight", d.sentence
    assert d.sentence.startswith("`module.2.weight` on rank 1 differs from step `step0` on (content differs from "
                                 "rank 0 (DDP replica))"), d.sentence


def test_a_loss_declared_same_on_world_that_differs_is_named(two):
    d = two["ddp-loss-world"].bug.diagnose()
    assert d.mechanism == "outputs-only" and d.ranks == [1], d.sentence
    assert "output `loss` on rank 1: differs from rank 0" in d.sentence and "`logits`" not in d.sentence
    assert "the cause is outside what was probed" in d.sentence


def test_expert_parallel_with_plain_tensors_reads_clean(two):
    _clean(two["ep"])
    t = two["ep"].bug.tensors
    last = t[t["step"] == "step1"]
    router = last[last["name"].str.contains("router")]
    experts = last[last["name"].str.contains("experts")]
    assert set(router["agree"]) == {"0,1"} and set(experts["agree"]) == {""}
    st = findings.status(last.drop(columns=["step", "step_index"])).set_index(["rank", "name"])["status"]
    assert st[(1, "model.experts.0.weight")] == "apart"  # visible, neutral: differs, not expected to agree


def test_a_router_that_differs_on_one_rank_is_named(two):
    d = two["ep-router"].bug.diagnose()
    assert d.mechanism == "diverged" and d.ranks == [1], d.sentence
    assert d.sentence.startswith("`router.weight`, `router.bias` on rank 1 differ from step `step0`"), d.sentence
    assert "experts" not in d.sentence


def test_a_tensor_parallel_module_reads_clean(two):
    _clean(two["tp"])
    t = two["tp"].bug.tensors
    t = t[(t["step"] == "forward") & (t["rank"] == 0)].set_index("name")
    assert t.loc["model.0.weight", "agree"] == "" and t.loc["model.2.bias", "agree"] == "0,1"  # Row's bias: Replicate
    assert t.loc["model.2.bias", "agree_by"] == "mesh dim `tp`"


def test_hsdp_replicas_diverging_at_init_read_as_replicas_parting(four):
    d = four["hsdp"].bug.diagnose()
    assert d.mechanism == "replicas-parted" and d.ranks == [2, 3] and d.tensor == "model.0.weight", d.sentence
    assert d.sentence.startswith("`model.0.weight`, `model.0.bias`, `model.2.weight` and 1 more differ between "
                                 "the replicas (mesh dim `replicate`: ranks 0,1 vs 2,3) from step `materialize`"), \
        d.sentence
    t = four["hsdp"].bug.tensors
    row = t[(t["rank"] == 3) & (t["name"] == "model.0.weight")].iloc[0]
    assert (row["agree"], row["replica"]) == ("1,3", "1")
    from workbench import viz  # the job's capture draws the mesh too: ranks by coordinate, the replica that parted

    fig = viz.status_matrix(t[t["step"] == "materialize"].drop(columns=["step", "step_index"]))
    assert list(fig.data[0].y) == [f"replicate {r // 2} · shard {r % 2} (rank {r})" for r in range(4)]
    assert "replica group parted: `replicate` 1 (ranks 2,3) differs from `replicate` 0 (ranks 0,1)" in \
        fig.data[0].text[3][0]


@pytest.mark.parametrize("fix", ["hsdp-seed-per-shard", "hsdp-broadcast"])
def test_hsdp_fixes_read_clean(four, fix):
    _clean(four[fix])


# -- without engines ------------------------------------------------------------------------------------------
def _rows(agree: dict[int, str], fps: dict[int, str], **more) -> pd.DataFrame:
    return pd.DataFrame([{"rank": r, "name": "w", "dtype": "float32", "numel": 4, "is_meta": False, "nan": 0,
                          "inf": 0, "poisoned": 0, "fingerprint": fps[r], "agree": agree[r], "agree_by": "",
                          **more} for r in sorted(fps)])


def test_a_row_is_compared_only_within_its_group():
    # two replica groups {0,2} and {1,3}: rank 3 equals rank 1, not rank 0; rank 2 departs from rank 0
    t = _rows({0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}, {0: "a", 1: "b", 2: "c", 3: "b"})
    st = findings.status(t).set_index("rank")
    assert list(st["status"]) == ["ok", "ok", "differs", "ok"]
    assert st.loc[2, "detail"] == "content differs from rank 0"
    # nothing says they agree: visible, neutral, never a finding
    own = findings.status(_rows({0: "", 1: ""}, {0: "a", 1: "b"}))
    assert list(own["status"]) == ["ok", "apart"] and own["detail"][1].startswith(findings.APART)
    assert findings.divergence("s", _rows({0: "", 1: ""}, {0: "a", 1: "b"}), pd.DataFrame(), pd.DataFrame()) == []


def test_records_without_the_columns_keep_todays_rule():
    t = _rows({0: "", 1: ""}, {0: "a", 1: "b"}).drop(columns=["agree", "agree_by"])
    assert list(findings.status(t)["status"]) == ["ok", "differs"]


def test_a_points_columns_are_reused_only_while_nothing_synced_since_and_never_from_a_gradient():
    """A job's point every step reads the columns its last point computed (``agree.annotate``'s cache, keyed by the
    probe's plan stamp): a collective since, or a new gradient, must still change them."""
    from workbench.rank import agree

    agree.forget()
    m = nn.Linear(4, 2)
    rows = lambda: [{"name": "m.weight"}, {"name": "m.bias"}]  # noqa: E731
    whole, every, stamp = {"m.weight": m.weight, "m.bias": m.bias}, {"m": m}, (("m", id(m), 1),)

    def read() -> dict[str, str]:
        got = rows()
        agree.annotate(got, whole, every, stamp=stamp)
        return {r["name"]: r["agree_by"] for r in got}

    assert read() == {"m.weight": "", "m.bias": ""}
    agree.synced([m.weight], [0, 1], "broadcast")  # since the last point: a new answer, same stamp
    assert read() == {"m.weight": "broadcast", "m.bias": "its module's `weight` was broadcast"}
    calls = []
    real = agree._columns
    agree._columns = lambda *a: calls.append(a) or real(*a)
    try:
        assert read()["m.weight"] == "broadcast" and calls == []  # nothing since: the last point's columns
        m.bias.grad = torch.ones(2)
        agree.synced([m.bias.grad], [0, 1], "all_reduce")
        assert read()["m.bias"] == "its gradient is all-reduced"
        m.bias.grad = torch.zeros(2)  # the next step's gradient: a new tensor that nothing synced, nothing bumped
        assert read()["m.bias"] == "its module's `weight` was broadcast" and len(calls) == 2
    finally:
        agree._columns = real
        agree.forget()



def test_a_tensor_broadcast_as_its_bytes_agrees():
    """DeepSpeed broadcasts each parameter as ``p.data.view(torch.uint8)``: the same memory under another dtype is
    the same tensor synced; a part of it is not the whole."""
    from workbench.rank import agree

    agree.forget()
    try:
        w, other = torch.randn(4, 8), torch.randn(4, 8)
        agree.synced([w.view(torch.uint8)], [0, 1], "broadcast")
        assert agree.of_tensor(w)["agree"] == "0,1" and agree.of_tensor(w)["agree_by"] == "broadcast"
        assert agree.of_tensor(other)["agree"] == ""
        agree.synced([other[0]], [0, 1], "broadcast")
        assert agree.of_tensor(other)["agree"] == ""  # its first row only
    finally:
        agree.forget()

def test_what_a_wrapper_says_holds_when_a_point_probes_the_module_inside_it():
    """A job's automatic points probe the module inside DDP or DeepSpeed's engine (``owners.unwrapped``); the
    wrapper's word (a replica, its buffers never synced) must still reach the columns. A user's ``replicated``
    stands."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from workbench.job import owners
    from workbench.rank import agree

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        agree.forget()
        net = nn.BatchNorm1d(4)
        ddp = DDP(net, broadcast_buffers=False)
        assert owners.unwrapped(ddp) is net and owners.wrappers(net) == [ddp]
        assert owners.wrappers(nn.Linear(2, 2)) == []
        before = agree._owned({"model": net})
        assert id(net.running_mean) not in before
        agree.wrapped(net, owners.wrappers(net))
        owned = agree._owned({"model": net})
        assert owned[id(net.weight)] == ((0,), "DDP replica")
        assert owned[id(net.running_mean)] == ((0,), "DDP replica, but broadcast_buffers=False: DDP never syncs "
                                                     "its buffers")
        calls = []
        real = agree._wrapper
        agree._wrapper = lambda w: calls.append(w) or real(w)
        try:  # the next point with the same wrappers asks them nothing (DeepSpeed's rule walks the parameters)
            agree.wrapped(net, owners.wrappers(net))
        finally:
            agree._wrapper = real
        assert calls == [] and agree._owned({"model": net})[id(net.weight)] == ((0,), "DDP replica")
        other = nn.Linear(2, 2)
        agree.replicated(other, [0])
        agree.wrapped(other, [DDP(other)])
        assert agree._owned({"m": other})[id(other.weight)] == ((0,), "declared replicated")
    finally:
        dist.destroy_process_group()
        agree.forget()

# -- a live data-parallel step --------------------------------------------------------------------------------
dp = wb.Scenario("dp-per-rank-batches", params={"break_mean": False})


@dp.step
def build(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ctx.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ctx.model = DDP(ctx.net)
    ctx.opt = torch.optim.SGD(ctx.model.parameters(), lr=0.1)


@dp.step
def train(ctx):
    g = torch.Generator().manual_seed(10 + ctx.rank)  # this rank's own batch
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    logits = ctx.model(x)
    loss = ((logits - y) ** 2).mean()
    ctx.opt.zero_grad()
    loss.backward()
    ctx.opt.step()
    ctx.output("logits", logits)
    ctx.output("loss", loss)
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # a collective makes this one agree: it is compared
    ctx.output("mean_loss", mean)
    if ctx.params.get("break_mean") and ctx.rank == 1:
        mean.add_(1.0)


def test_a_live_dp_step_with_per_rank_batches_reads_clean(cluster):
    live = ready(cluster)
    s = live.session(dp)
    s.run()
    d = s.diagnose()
    assert d.clean, d.sentence
    o = s.record().outputs
    assert dict(zip(o[o["rank"] == 0]["name"], o[o["rank"] == 0]["agree"])) == \
        {"logits": "", "loss": "", "mean_loss": "0,1"}
    broken = live.session(dp, break_mean=True)
    broken.run()
    d = broken.diagnose()
    assert d.mechanism == "outputs-only" and "output `mean_loss` on rank 1: differs from rank 0" in d.sentence, \
        d.sentence
    assert "`loss`" not in d.sentence and "`logits`" not in d.sentence


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.gain = 1.0  # a plain float: outside what the probe reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.gain


fed = wb.Scenario("same-inputs", params={"gain_on_rank1": 1.0})


@fed.step
def build_scaled(ctx):
    torch.manual_seed(0)
    ctx.model = Scaled()
    if ctx.rank == 1:
        ctx.model.gain = ctx.params["gain_on_rank1"]


@fed.step
def forward(ctx):
    torch.manual_seed(5)  # every rank feeds the same batch: the outputs are expected to agree
    with torch.no_grad():
        ctx.output("y", ctx.model(torch.randn(2, 8)))


def test_outputs_of_forwards_fed_the_same_inputs_are_expected_to_agree(cluster):
    live = ready(cluster)
    s = live.session(fed)
    s.run()
    assert s.diagnose().clean, s.diagnose().sentence
    s = live.session(fed, gain_on_rank1=2.0)
    s.run()
    d = s.diagnose()
    assert d.mechanism == "outputs-only" and "output `y` on rank 1: differs from rank 0" in d.sentence, d.sentence
    assert "the cause is outside what was probed" in d.sentence


def _hsdp(mesh: list[list[int]], fps: dict[int, str]) -> pd.DataFrame:
    """One weight on a 2 x 2 (replicate, shard) mesh laid out as ``mesh``: the rows a probe of HSDP gives."""
    coord = {r: (i, j) for i, row in enumerate(mesh) for j, r in enumerate(row)}
    agree = {r: ",".join(str(x) for x in sorted(mesh[i][coord[r][1]] for i in range(2))) for r in coord}
    return _rows(agree, fps, agree_by="mesh dim `replicate`").assign(
        replica=[str(coord[r][0]) for r in sorted(fps)],
        mesh_coord=[f"replicate={coord[r][0]}, shard={coord[r][1]}" for r in sorted(fps)],
        placement="replicate=Replicate(), shard=Shard(dim=0) on mesh 2x2", shape="2", head=[[0.0]] * 4)


def test_the_status_matrix_follows_the_mesh_and_says_which_replica_parted():
    from workbench import viz

    # ranks laid out column-major: replica 0 is ranks 0,2, replica 1 ranks 1,3; replica 1's shards differ
    t = _hsdp([[0, 2], [1, 3]], {0: "a", 2: "b", 1: "c", 3: "d"})
    fig = viz.status_matrix(t)
    assert list(fig.data[0].y) == ["replicate 0 · shard 0 (rank 0)", "replicate 0 · shard 1 (rank 2)",
                                   "replicate 1 · shard 0 (rank 1)", "replicate 1 · shard 1 (rank 3)"]
    hover = {y: row[0] for y, row in zip(fig.data[0].y, fig.data[0].text)}
    said = "replica group parted: `replicate` 1 (ranks 1,3) differs from `replicate` 0 (ranks 0,2)"
    assert all(said in h for h in hover.values()), hover
    # the replicas agree: no replica parted, and the shards (which differ by design) read ok
    same = viz.status_matrix(_hsdp([[0, 2], [1, 3]], {0: "a", 2: "b", 1: "a", 3: "b"}))
    assert not any("parted" in h[0] for h in same.data[0].text)
    assert findings.status(_hsdp([[0, 2], [1, 3]], {0: "a", 2: "b", 1: "a", 3: "b"}))["status"].eq("ok").all()
    # without a mesh (or a recording from before the column) the rows stay ranks
    assert list(viz.status_matrix(t.drop(columns=["mesh_coord"])).data[0].y) == [f"rank {r}" for r in range(4)]


def test_both_sides_of_a_replica_split_are_shortened_alike():
    """A 64-rank mesh's sentence stays one line: the second side of "vs" reads as a range too (it listed every rank)."""
    from workbench.analysis.diagnosis_rules.tensor import replica_sides

    assert replica_sides([[0, 1], [2, 3]]) == "ranks 0,1 vs 2,3"
    assert replica_sides([[0, 1, 2, 3], [4, 5, 6, 7]]) == "ranks 0-3 vs 4-7"
    assert replica_sides([list(range(32)), list(range(32, 64))]) == "ranks 0-31 vs 32-63"


# -- expert parallel in a live session: the router fed the same tokens on every rank (issue 61) -------------------
class MoE(nn.Module):
    """Each rank its own experts (seeded by rank), the router replicated (one seed) unless ``router_seed`` says."""

    def __init__(self, rank: int, router_seed: int) -> None:
        super().__init__()
        torch.manual_seed(router_seed)
        self.router = nn.Linear(8, 2)
        torch.manual_seed(100 + rank)
        self.experts = nn.ModuleList([nn.Linear(8, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.router(x).softmax(-1)
        return sum(w[:, k:k + 1] * e(x) for k, e in enumerate(self.experts))


ep_live = wb.Scenario("ep-live", params={"router_seed_on_rank1": 0, "declare": False})


@ep_live.step
def build_moe(ctx):
    ctx.model = MoE(ctx.rank, ctx.params["router_seed_on_rank1"] if ctx.rank == 1 else 0)
    if ctx.params["declare"]:
        wb.replicated(ctx.model.router)  # what the job knows and the data cannot say: the router is a replica


@ep_live.step
def route(ctx):
    torch.manual_seed(5)  # the same tokens on every rank
    with torch.no_grad():
        ctx.output("router_logits", ctx.model.router(torch.randn(4, 8)))  # the router's own forward, outermost


@ep_live.step
def moe_forward(ctx):
    torch.manual_seed(5)
    with torch.no_grad():
        ctx.output("y", ctx.model(torch.randn(4, 8)))  # the experts differ by design: so does y


def test_expert_parallel_fed_the_same_tokens_reads_clean_called_either_way(cluster):
    """Right EP code: the MoE fed the same tokens on every rank outputs per-rank values (each rank's own experts).
    Before, the same-inputs rule read that as "output `y` on rank 1: differs from rank 0 ... the cause is outside
    what was probed"; the digest now holds the module's own per-rank tensors beside its inputs."""
    live = ready(cluster)
    s = live.session(ep_live)
    s.run()
    d = s.diagnose()
    assert d.clean, d.sentence
    o = s.record().outputs
    y = o[(o["step"] == "moe_forward") & (o["name"] == "y")]
    assert y["fingerprint"].nunique() == 2  # the outputs differ, by design
    route_ = o[(o["step"] == "route") & (o["name"] == "router_logits")]
    assert route_["inputs"].nunique() == 1 and route_["inputs"].iloc[0] != ""  # the router's own forward is seen


def test_a_router_seeded_apart_is_named_where_the_job_says_it_is_a_replica(cluster):
    """With nothing saying the router is a replica, a router whose weights differ on rank 1 is indistinguishable
    from an expert (per-rank weights, the same tokens in, per-rank outputs out): it reads clean, as
    docs/collectives.md says. Declared (or its gradients all-reduced:
    ``test_a_router_that_differs_on_one_rank_is_named``), the weights are named."""
    live = ready(cluster)
    s = live.session(ep_live, router_seed_on_rank1=7)
    s.run()
    assert s.diagnose().clean, s.diagnose().sentence
    s = live.session(ep_live, router_seed_on_rank1=7, declare=True)
    s.run()
    d = s.diagnose()
    assert d.sentence.startswith("`router.weight`, `router.bias` on rank 1 differ from step `build_moe` on"), \
        d.sentence
    o = s.record().outputs
    route_ = o[(o["step"] == "route") & (o["name"] == "router_logits")]
    assert route_["inputs"].nunique() == 1, route_  # a replica's weights stay out of the digest: its output must agree


def test_a_ddp_batchnorm_job_on_per_rank_batches_reads_clean(tmp_path):
    """DDP broadcasts rank 0's buffers at each forward; each rank's forward then updates its own running statistics,
    so at a step point they differ by design. They read as each rank's own, said why; the parameters are compared
    (it read "`running_mean`, `running_var` on rank 1 differ", a false alarm, before)."""
    from test_job_zero_code import JOB, JOBS, TORCHRUN, _run, _says

    out = tmp_path / "cap"
    run = _run([*JOB, str(out), "--every", "1", "--", *TORCHRUN, str(JOBS / "ddp_batchnorm_job.py")], tmp_path)
    assert run.returncode == 0, _says(run)
    b = wb.load(out)
    d = b.bug.diagnose()
    assert d.clean, d.sentence
    t = b.bug.tensors
    stats = t[t["name"].str.contains("running_")]
    last = stats[stats["step"] == "step3"]
    assert last.groupby("name")["fingerprint"].nunique().eq(2).all(), last  # they do differ: nothing hid them
    assert (stats["agree"] == "").all() and stats["agree_by"].str.startswith("DDP broadcasts them").all(), stats
    weights = t[t["name"].str.endswith("0.weight")]
    assert (weights["agree"] == "0,1").all() and (weights["agree_by"] == "DDP replica").all(), weights
