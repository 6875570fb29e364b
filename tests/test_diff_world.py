"""``workbench diff`` of two runs at different world sizes reads every rank of the larger run (issue 61).

One user's script (``tests/jobs/diff_world_job.py``, no line of the workbench in it) under ``workbench job``,
real torchrun, gloo, CPU, each run once per module: as written at 2 ranks (right: its broadcast group ``[0, 1]``
is every rank) and at 4 (ranks 2 and 3 never get the buffer ``scale``), and its fix at 2 and at 4. The FSDP2
parameters are sharded 2 ways in one run and 4 in the other; the buffer is replicated; the forward's output is
each rank's own (the automatic point declares it so). Then a right FSDP1 job (flat parameters, padded at 4).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jobrun
import pytest

import workbench as wb
from workbench import cli
from workbench.job import hooks

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "diff_world_job.py"
ENVS = ("WORKBENCH_CAPTURE", "WORKBENCH_JOB_ID", "WORKBENCH_CAPTURE_LEDGER", hooks.ENV_PID, hooks.ENV_EVERY,
        hooks.ENV_POINTS, hooks.ENV_ATTACH, hooks.ENV_POISON, hooks.ENV_DEADLINE)


def _job(out: Path, ranks: int, *args: str, script: Path = JOB) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENVS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    cmd = [sys.executable, "-m", "workbench.cli", "job", str(out), "--", sys.executable, "-m",
           "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(script), *args]
    run = jobrun.run(cmd, out, timeout=600, env=env, cwd=out.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("world")
    _job(base / "good2", 2)
    _job(base / "bad4", 4)
    _job(base / "fix2", 2, "--fix")
    _job(base / "fix4", 4, "--fix")
    return base


def test_the_bad_run_at_4_names_the_buffer_ranks_2_and_3_never_got(runs, capsys):
    report = wb.load(runs / "bad4").bug.diagnose().sentence
    assert "`scale` on ranks 2,3 was never written" in report, report  # what the user's report of bad4 says
    d = wb.diff(runs / "good2", runs / "bad4")
    s = str(d)
    print(s)
    assert not d.same
    assert d.first["point"] == "forward" and d.first["name"] == "model.scale", d.first
    assert d.first["kind"] == "written" and d.first["ranks"] == [2, 3], d.first
    assert "at `forward` `scale`: written in good2, never written in bad4 on ranks 2,3" in s
    assert "ranks 2,3 are only in bad4: read against good2's rank 0" in s
    # the broadcast ranks 2,3 never joined: their calls read against the smaller run's ranks, none alike
    assert d.collective is not None and d.collective["ranks"] == [2, 3], d.collective
    assert "broadcast #9 at `forward` (ranks 2,3: fp32 in good2 vs no call in bad4; ranks 2,3 only in bad4: no " \
           "rank of good2 issued their calls" in s
    # the sharded parameters agree through their summaries across 2 and 4 shards: never the story
    params = d.cells[d.cells["name"].str.contains("weight|bias")]
    assert len(params) and set(params["kind"]) <= {"same", "within rounding"}, params
    assert cli.main(["diff", str(runs / "good2"), str(runs / "bad4")]) == 1
    assert "`scale`" in capsys.readouterr().out


def test_the_larger_run_first_reads_the_same(runs):
    d = wb.diff(runs / "bad4", runs / "good2")
    assert d.first["name"] == "model.scale" and d.first["ranks"] == [2, 3], str(d)
    assert d.first["detail"].startswith("never written in bad4, written in good2"), d.first


def test_the_output_ranks_2_and_3_computed_from_the_unwritten_buffer_is_a_difference_too(runs):
    d = wb.diff(runs / "good2", runs / "bad4")
    out = d.cells[(d.cells["table"] == "output") & (d.cells["point"] == "forward")].iloc[0]
    assert out["kind"] == "NaN/Inf/poison" and out["ranks"] == [2, 3], out.to_dict()


def test_right_code_at_4_against_2_reads_the_same_and_exits_0(runs, capsys):
    d = wb.diff(runs / "fix2", runs / "fix4")
    s = str(d)
    print(s)
    assert d.same and d.collective is None, s
    assert s.startswith("the runs' settings differ: fix2 ran on 2 ranks, fix4 on 4 (ranks 2,3 are only in fix4")
    assert "the same bytes at every point" in s or "the same within rounding at every point" in s
    # FSDP2's parameters: 2 shards against 4, read through their summaries, every one alike
    sharded = d.cells[d.cells["name"].str.contains("weight|bias") & (d.cells["point"] != "fully_shard")]
    assert len(sharded) == 4 * 3 and set(sharded["kind"]) <= {"same", "within rounding"}, sharded
    assert set(sharded["detail"]) <= {"the same summaries across shards", "within rounding across shards"}
    # the replicated buffer: every rank of fix4 read, ranks 2,3 against fix2's value
    scale = d.cells[(d.cells["name"] == "model.scale") & (d.cells["point"] == "forward")].iloc[0]
    assert scale["kind"] == "same" and scale["ranks"] == [0, 1, 2, 3], scale.to_dict()
    assert cli.main(["diff", str(runs / "fix2"), str(runs / "fix4")]) == 0
    capsys.readouterr()


def test_each_ranks_own_output_is_compared_by_summaries_and_said_as_such(runs):
    """An output no rule says must agree (here the forward's, which the automatic point declares this rank's own)
    may differ per rank across world sizes (a data-parallel batch): its summaries are said, never a cause."""
    a, b = wb.load(runs / "fix2").bug, wb.load(runs / "fix4").bug
    o = b.outputs
    on3 = o["rank"] == 3
    o.loc[on3, "fingerprint"] = "0123456789abcdef"
    o.loc[on3, "mean"] = o.loc[on3, "mean"] + 1.0
    o.loc[on3, "max"] = o.loc[on3, "max"] + 1.0
    b.outputs = o
    d = wb.diff(a, b, labels=("two", "four"))
    cell = d.cells[d.cells["table"] == "output"].iloc[0]
    assert cell["kind"] == "each rank's own" and cell["ranks"] == [3], cell.to_dict()
    assert cell["detail"].startswith("each rank's own, not expected to agree: mean "), cell["detail"]
    assert "over 2 ranks in two" in cell["detail"] and "over 4 ranks in four" in cell["detail"]
    assert d.same, str(d)
    assert "1 output is each rank's own and differs (summaries said, not compared)" in str(d)


def test_a_replicated_tensor_on_a_rank_only_the_larger_run_has_is_compared_with_the_smaller_runs_value(runs):
    """The buffer's bytes changed on rank 3 alone: today's diff read ranks 0,1 and nothing beyond them."""
    a, b = wb.load(runs / "fix2").bug, wb.load(runs / "fix4").bug
    t = b.tensors
    at = (t["rank"] == 3) & (t["name"] == "model.scale") & (t["step"] == "forward")
    t.loc[at, "fingerprint"] = "0123456789abcdef"
    t.loc[at, "mean"] = t.loc[at, "mean"] * 2
    t.loc[at, "max"] = t.loc[at, "max"] * 2
    t.loc[at, "head"] = t.loc[at, "head"].map(lambda h: [2 * x for x in h])
    b.tensors = t
    d = wb.diff(a, b, labels=("two", "four"))
    assert d.first is not None and d.first["name"] == "model.scale" and d.first["ranks"] == [3], str(d)
    assert d.first["kind"] == "values"


# -- FSDP1's flat parameter: 39 elements a rank at 2 ranks, 20 at 4 (2 of them padding) ---------------------------
FSDP1_JOB = ROOT / "tests" / "jobs" / "diff_fsdp1_job.py"


@pytest.fixture(scope="module")
def flat(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("flat")
    for n in (2, 4):
        _job(base / f"ws{n}", n, script=FSDP1_JOB)
    return base


def test_a_right_fsdp1_job_reads_clean_at_each_world_size(flat):
    """The flat parameter is each rank's shard: torch makes it a ``Parameter`` marked ``_is_flat_param``, which the
    rank read by its type's name alone as FSDP's replica ("`_flat_param` on ranks 1-3 differs from step ...")."""
    for n in (2, 4):
        rec = wb.load(flat / f"ws{n}").bug
        assert set(rec.tensors["agree_by"]) == {"an FSDP flat parameter's shard"}
        d = rec.diagnose()
        assert d.clean, d.sentence


def test_fsdp1_flat_shards_at_2_and_4_ranks_read_the_same_padding_and_all(flat, capsys):
    d = wb.diff(flat / "ws2", flat / "ws4")
    assert d.same, str(d)
    cells = d.cells[d.cells["name"].str.endswith("_flat_param")]
    assert len(cells) and set(cells["expect"]) == {"sharded"} and set(cells["kind"]) <= {"same", "within rounding"}
    assert cli.main(["diff", str(flat / "ws2"), str(flat / "ws4")]) == 0
    capsys.readouterr()
    # a shard that really differs is still named: rank 3's values shifted
    a, b = wb.load(flat / "ws2").bug, wb.load(flat / "ws4").bug
    t = b.tensors
    on3 = (t["rank"] == 3) & (t["step"] == "forward")
    t.loc[on3, "mean"] = t.loc[on3, "mean"] + 0.5
    t.loc[on3, "max"] = t.loc[on3, "max"] + 0.5
    b.tensors = t
    d = wb.diff(a, b, labels=("two", "four"))
    assert d.first is not None and d.first["name"].endswith("_flat_param") and d.first["kind"] == "values", str(d)
