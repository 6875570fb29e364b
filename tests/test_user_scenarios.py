"""Scenarios written by users: in a module (shipped by value), in a file run headless, and %%px helpers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from conftest import ready
from torch import nn

import workbench as wb
from workbench.analysis.findings import status
from workbench.errors import ClusterError, WorkbenchError


class Scaled(nn.Module):
    """A home-made model with a non-persistent buffer: not in the state dict, so never broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


sc = wb.Scenario("forgotten-buffer", probe=None)
sc.fix("reinit-buffers", "recompute non-persistent buffers after to_empty")


@sc.step
def build(ctx):
    torch.manual_seed(0)
    if ctx.rank == 0:
        ctx.model = Scaled()
    else:
        with torch.device("meta"):
            ctx.model = Scaled()
    ctx.expect("model.scale", torch.full((8,), 0.5))


@sc.step
def materialize(ctx):
    if ctx.rank != 0:
        ctx.model.to_empty(device=ctx.device)
        if ctx.fix == "reinit-buffers":
            ctx.model.scale.fill_(0.5)


@sc.step
def sync(ctx):
    for t in ctx.model.state_dict().values():
        dist.broadcast(t, src=0)


@sc.step
def forward(ctx):
    with torch.no_grad():
        ctx.output("y", ctx.model(torch.ones(2, 8)))


boom = wb.Scenario("boom-on-rank-1")


@boom.step
def prepare(ctx):
    ctx.weights = {"w": torch.arange(4.0) + ctx.rank * 0}


@boom.step
def explode(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank 1 blew up on purpose")
    ctx.weights["w"].mul_(2)


def test_user_scenario_from_a_module_shows_the_bug_and_the_fix(healthy):
    s = healthy.session(sc)
    assert s.steps == ["build", "materialize", "sync", "forward"]
    s.run()
    last = s.frames[-1]
    st = status(last.tensors).set_index(["rank", "name"])["status"]
    assert st[(0, "model.scale")] == "ok" and st[(1, "model.scale")] == "poison"
    assert st[(1, "model.proj.weight")] == "ok"  # the state dict did arrive
    out = last.outputs.set_index("rank")
    assert out.loc[0, "nan"] == 0 and out.loc[1, "nan"] == out.loc[1, "numel"]
    found = s.findings()
    assert ((found["detector"] == "reference") & (found["rank"] == 1)).any()
    fixed = s.compare("reinit-buffers").fixed
    assert (status(fixed.frames[-1].tensors)["status"] == "ok").all()
    fo = fixed.frames[-1].outputs
    assert (fo["nan"] == 0).all() and fo["fingerprint"].nunique() == 1


def test_a_step_raising_on_one_rank_keeps_the_other_ranks_state(healthy):
    s = healthy.session(boom)
    s.run()
    frame = s.frames[-1]
    assert set(frame.rank_errors) == {1} and "blew up on purpose" in frame.rank_errors[1]
    tb = frame.events.set_index("rank").loc[1, "traceback"]
    assert "RuntimeError" in tb and "explode" in tb
    w = frame.tensors.set_index("rank")
    assert w.loc[0, "head"][:2] == [0.0, 2.0] and w.loc[1, "head"][:2] == [0.0, 1.0]
    s.reset()
    assert s.step().step == "prepare"  # the session can be reset and stepped again


def test_px_helpers_and_client_probe(healthy):
    view = healthy._client[healthy._ids]
    healthy.activate()
    view.execute(textwrap.dedent("""
        import torch
        from torch import nn
        net = wbr.build_on_meta(nn.Linear, 8, 4)
        if rank == 0:
            torch.manual_seed(0)
            net = nn.Linear(8, 4)
        else:
            wbr.materialize(net)
        before = wbr.probe_rows({"net": net})
        calls = wbr.sync_module_states(net)
        out, tr = wbr.forward(net, torch.ones(2, 8))
    """), block=True)
    rows = healthy.probe("net")
    assert set(rows["rank"]) == {0, 1} and rows.groupby("name")["fingerprint"].nunique().eq(1).all()
    before = view.pull("before", block=True)
    assert {r["name"]: r["poisoned"] for r in before[1]} == {"net.weight": 32, "net.bias": 4}
    calls = view.pull("calls", block=True)
    starts = [c for c in calls[1] if c["ev"] == "start"]
    assert [(c["op"], c["via"], c["numel"]) for c in starts] == [("broadcast", "_broadcast_coalesced", 36)]
    assert len(view.pull("tr", block=True)[0]) == 1
    with pytest.raises(ClusterError, match="no variable"):
        healthy.probe("not_defined_anywhere")


def test_scenario_file_runs_headless(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent('''
        import torch
        import workbench as wb

        sc = wb.Scenario("from-a-file")

        @sc.step
        def make(ctx):
            ctx.state = {"x": torch.full((4,), float(ctx.rank))}
    '''))
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "run", f"{path}:sc", "--timeout", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "from-a-file" in out.stdout and "state.x" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "workbench.cli", "run", f"{path}:nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "has no Scenario named 'nope'; it has: sc" in bad.stderr


def test_scenario_declaration_errors():
    s = wb.Scenario("dup")
    s.step(lambda ctx: None, name="a")
    with pytest.raises(WorkbenchError, match="already has a step 'a'"):
        s.step(lambda ctx: None, name="a")


def test_a_session_whose_ranks_were_re_formed_replays_instead_of_filling_junk_frames(healthy):
    s = healthy.session(sc)
    s.step()
    healthy.dirty = True
    healthy.form_group()  # what recover() and another session's start do: every rank's state is dropped
    frame = s.step()  # the ranks are brought back to the cursor first: step 0 replayed, then step 1
    assert frame.ok and frame.index == 1 and len(s.frames) == 2
    assert s.frames[0].replayed and "same fingerprints" in " ".join(s.frames[0].notes[0])


def test_px_calls_on_a_stopped_cluster_are_one_clear_error():
    c = wb.Cluster(ranks=1, backend="gloo")
    for call in (c.activate, lambda: c.push(x=1), lambda: c.probe("x")):
        with pytest.raises(ClusterError, match="stopped"):
            call()


# -- a user's own mesh: two subgroups, two failures in one step ----------------------------------------------
mesh = wb.Scenario("two-groups-two-failures", probe=None)
PAIRS = ((0, 3), (1, 2))


@mesh.step
def pair_up(ctx):
    made = [(g, dist.new_group(list(g))) for g in PAIRS]  # plain c10d: every rank forms every group, in order
    ctx.pair = next(pg for g, pg in made if ctx.rank in g)
    ctx.w = {"w": torch.ones(4)}


@mesh.step
def exchange(ctx):
    t = torch.full((4,), float(ctx.rank))
    if ctx.rank in PAIRS[0]:
        dist.broadcast(t, src=1, group=ctx.pair)  # a bad argument: rank 1 is not in this pair
    else:
        dist.broadcast(t, src=ctx.rank, group=ctx.pair)  # each rank of the other pair takes itself for the root


both_pairs = wb.Scenario("both-pairs-disagree", probe=None)
both_pairs.step(pair_up)


@both_pairs.step
def both_roots(ctx):
    dist.broadcast(torch.full((4,), float(ctx.rank)), src=ctx.rank, group=ctx.pair)  # every rank its own root


def _two_steps(cluster, scenario):
    s = ready(cluster).session(scenario)
    s.step()
    frame = s.step()
    return frame, s.diagnose()


@pytest.fixture(scope="module")
def mesh_run(mesh4):
    """The mesh scenario run once on 4 gloo ranks: (its last frame, its diagnosis)."""
    return _two_steps(mesh4, mesh)


@pytest.mark.slow
def test_a_root_reads_as_the_global_rank_the_user_passed(mesh_run):
    _, d = mesh_run
    # rank 2 wrote src=2; c10d's group rank (1) goes beside it, never in its place
    assert "rank 2: broadcast #1 float32 [4] 16 B src=2 (group rank 1) at " in d.sentence, d.sentence
    assert "rank 1: broadcast #1 float32 [4] 16 B src=1 (group rank 0) at " in d.sentence, d.sentence


@pytest.mark.slow
def test_every_independent_failure_of_a_step_is_told_and_different_roots_are_released(mesh_run):
    frame, d = mesh_run
    # the raising pair's exception first (a cause), then the other pair's parted broadcast (its own story)
    assert d.sentence.startswith("ranks 0,3 raised ValueError at "), d.sentence
    assert "Global rank 1 is not part of group <ProcessGroup>" in d.sentence, d.sentence
    assert "; independently, on group " in d.sentence and "(ranks 1,2): " in d.sentence, d.sentence
    assert d.sentence.index("raised ValueError") < d.sentence.index("(different roots)"), d.sentence
    assert "ranks 1,2 hung in broadcast #1 (released by the workbench)" in d.sentence, d.sentence
    for r, msg in frame.rank_errors.items():  # no rank's exception is left out
        assert f"{r}" in d.sentence and "did not free" not in msg, (r, msg)
    for r in (1, 2):  # a released call reads as the workbench's release, never as gloo's cut socket
        msg = frame.rank_errors[r]
        assert "aborted by the workbench: it released broadcast #1" in msg and "pair.cc" not in msg, msg
        assert "Connection closed" not in msg, msg
    # the call with different roots is declared and released from the ledgers, not left to the 20 s timeout
    assert sorted(frame.released) == [1, 2] and frame.hang.caught_by == "ledger deadlock"
    # released by the workbench, before the group's 20 s timeout could have cut it: no rank's error is gloo's
    # timeout (how soon is benchmarks/hang_cycles.py's figure, not a test's)
    assert not any("Timed out" in msg for msg in frame.rank_errors.values()), frame.rank_errors


@pytest.mark.slow
def test_two_groups_that_part_on_their_own_are_both_told_and_both_released(mesh4):
    frame, d = _two_steps(mesh4, both_pairs)
    assert sorted(frame.released) == [0, 1, 2, 3] and frame.hang.caught_by == "ledger deadlock", frame.rank_errors
    assert "different roots" in d.sentence and "; independently, on group " in d.sentence, d.sentence
    assert "rank 3: broadcast #1 float32 [4] 16 B src=3 (group rank 1)" in d.sentence, d.sentence  # pair (0,3)
    assert "rank 2: broadcast #1 float32 [4] 16 B src=2 (group rank 1)" in d.sentence, d.sentence  # pair (1,2)
    assert d.sentence.endswith("ranks 0-3 hung in broadcast #1 (released by the workbench)"), d.sentence
    # released before the group's own timeout could have ended it: no rank's error is gloo's timeout
    assert not any("Timed out" in msg for msg in frame.rank_errors.values()), frame.rank_errors


PIPED = '''
import torch
import torch.distributed as dist
import workbench as wb

piped = wb.Scenario("piped-to-python", probe=None)


@piped.step
def lonely(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(4))  # rank 1 never joins
'''


def test_a_script_piped_to_python_names_its_own_line_not_the_engines(healthy):
    """``python - <<EOF``: the user's code names ``<stdin>``; the library frame is not ipyparallel's ``do_apply``."""
    ns = {"__name__": "piped_user_script", "__file__": "<stdin>"}
    exec(compile(PIPED, "<stdin>", "exec"), ns)
    s = healthy.session(ns["piped"])
    s.run()
    d = s.diagnose()
    line = PIPED.splitlines().index("        dist.all_reduce(torch.ones(4))  # rank 1 never joins") + 1
    assert f"all_reduce #1 float32 [4] 16 B at <stdin>:{line} lonely)" in d.sentence, d.sentence
    assert "kernel.py" not in d.sentence and "do_apply" not in d.sentence, d.sentence
    row = s.ledger.iloc[0]
    assert row["user_frame"] == f"<stdin>:{line} lonely" and not row["library_frame"], dict(row)


# -- a user's own tied head: tied on meta, untied by to_empty, loaded from a checkpoint of the embedding -------
class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # one tensor under two names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


tied = wb.Scenario("tied-head-on-meta")
tied.fix("retie", "tie the head to the embedding again after to_empty")


@tied.step
def build_tied(ctx):
    with torch.device("meta"):
        ctx.model = TiedLM()


@tied.step
def materialize_tied(ctx):
    ctx.model.to_empty(device=ctx.device)  # each module's parameter is replaced on its own: the tie breaks
    if ctx.fix == "retie":
        ctx.model.head.weight = ctx.model.embed.weight


@tied.step
def load_checkpoint(ctx):
    ckpt = {"embed.weight": torch.randn(16, 8, generator=torch.Generator().manual_seed(0))}  # a tied save
    ctx.model.load_state_dict(ckpt, strict=False)


@tied.step
def logits(ctx):
    with torch.no_grad():
        ctx.output("logits", ctx.model(torch.arange(4)))


def test_a_tie_that_breaks_at_materialisation_is_named_as_the_cause(healthy):
    s = healthy.session(tied)
    s.run()
    built = s.frames[0].tensors.set_index(["rank", "name"])
    assert built.loc[(0, "model.embed.weight"), "shares"] == "model.head.weight"  # the probe sees the tie
    d = s.diagnose()
    assert d.mechanism == "never-written" and d.tensor == "model.head.weight", d.sentence
    assert ("`head.weight` and `embed.weight` were one tensor (tied) until step `materialize_tied` and are two "
            "after it") in d.sentence, d.sentence
    assert "`tie_weights()` after `to_empty`" in d.sentence, d.sentence
    found = s.findings()
    broke = found[found["detector"] == "tie broken"]
    assert list(broke["step"]) == ["materialize_tied"] and "`model.embed.weight` and `model.head.weight` were one " \
        "tensor (tied) before step `materialize_tied`" in broke["finding"].iloc[0], broke
    view = wb.viz.ties_view(s.history).data[0]  # the tie, step by step: held on meta, broken from to_empty on
    assert list(view.y) == ["`embed.weight` = `head.weight`"] and list(view.text[0]) == [
        "one tensor", "two tensors", "two tensors", "two tensors"], view.text
    fixed = s.compare("retie").fixed
    assert fixed.diagnose().clean, fixed.diagnose().sentence
    assert not (fixed.findings()["detector"] == "tie broken").any()
    ties = fixed.frames[-1].tensors.set_index(["rank", "name"])["shares"]
    assert ties[(1, "model.embed.weight")] == "model.head.weight"  # the tie holds to the end


bad_root = wb.Scenario("a-root-out-of-range", probe=None)


@bad_root.step
def send_weights(ctx):
    t = torch.ones(4)
    if ctx.rank == 0:
        dist.broadcast(t, group_src=3)  # the backend refuses it: the world has 2 ranks
    else:
        dist.broadcast(t, src=0)


def test_an_argument_the_backend_refuses_leads_as_the_raising_ranks_cause(healthy):
    s = healthy.session(bad_root)
    s.run()
    d = s.diagnose()
    assert d.sentence.startswith("rank 0 raised RuntimeError at ") and "invalid root rank: 3; it left rank 1 " \
        "waiting: " in d.sentence, d.sentence
    assert "rank 1 hung in broadcast #1 (released by the workbench)" in d.sentence, d.sentence
