"""Meshes, declared, and the sweep over them: which world sizes a scenario runs on, and where a bug shows."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import workbench as wb
from workbench.errors import WorkbenchError
from workbench.live.sweep import combinations

# A threshold bug: every rank packs `stages` equal slices except that, from `stages` > 2 on, the middle
# stages own no embedding, so their buffers are shorter; receivers slice with rank 0's sizes. Clean at
# stages <= 2 (identical layouts), wrong above: the shape of the weight-sync incident, in a few lines.
threshold = wb.Scenario("threshold", params={"stages": 2}, probe=["received"])
threshold.mesh("N <= 4", lambda n, p: n <= 4)


@threshold.step
def ship(ctx):
    stages = ctx.params["stages"]
    stage = ctx.rank % stages
    middle = 0 < stage < stages - 1
    mine = torch.arange(6 if middle else 8, dtype=torch.float32)
    sizes = torch.tensor([mine.numel()])
    dist.broadcast(sizes, src=0)  # the bug: rank 0's metadata for everyone
    got = torch.zeros(8)
    got[: int(sizes)] = torch.cat([mine, torch.full((8,), float("nan"))])[: int(sizes)]
    ctx.received = {"w": got}  # a middle stage that sliced 8 with rank 0's size read 2 values past its own


def test_combinations_cover_the_grid_in_order():
    assert combinations({"a": [1, 2], "b": ["x"]}) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]
    assert combinations({}) == [{}]


def test_a_mesh_the_scenario_cannot_lay_out_is_refused_in_one_line():
    with pytest.raises(WorkbenchError, match=r"threshold runs on N <= 4; 8 rank\(s\) is not one of them"):
        threshold.check_ranks(8)
    with pytest.raises(WorkbenchError, match="1 rank"):
        threshold.check_ranks(1)
    threshold.check_ranks(4, {"stages": 3})  # allowed: no error


def test_the_cli_refuses_an_unsupported_mesh_before_any_engine_starts(tmp_path):
    f = tmp_path / "user_threshold.py"
    f.write_text("import workbench as wb\nsc = wb.Scenario('narrow')\nsc.mesh('N = 2', lambda n, p: n == 2)\n"
                 "@sc.step\ndef noop(ctx):\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "run", f"{f}:sc", "--ranks", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "narrow runs on N = 2; 3 rank(s) is not one of them" in out.stderr and "Traceback" not in out.stderr
    assert "engines" not in out.stdout  # nothing started


def test_workbench_list_says_which_meshes_each_scenario_runs_on():
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "list"], capture_output=True, text=True, timeout=60)
    lines = [x for x in out.stdout.splitlines() if not x.startswith(" ")]
    assert lines and all("[ranks: " in x for x in lines)


def test_the_sweep_finds_the_threshold_and_skips_meshes_it_cannot_run(cluster):
    result = wb.sweep(threshold, ranks=[2, 8], grid={"stages": [1, 2, 3]}, cluster=cluster)
    t = result.table
    at2 = t[t["ranks"] == 2].set_index(t[t["ranks"] == 2]["params"].map(lambda p: p["stages"]))
    assert not at2.loc[1, "shows"] and not at2.loc[2, "shows"]  # identical layouts: silent
    assert at2.loc[3, "shows"] and at2.loc[3, "mechanism"] != "clean"  # rank 1 is a middle stage: wrong bytes
    assert at2.loc[1, "mechanism"] == "clean"
    at8 = t[t["ranks"] == 8]
    assert len(at8) == 3 and (at8["mechanism"] == "unsupported").all()  # no 8-rank cluster was started
    assert "shows at N=2 (stages=3)" in result.where() and "clean at N=2 (stages=1), N=2 (stages=2)" in result.where()
    assert cluster.alive  # the caller's ranks stay up


def test_sweep_view_colours_each_cell():
    import pandas as pd

    t = pd.DataFrame([
        {"ranks": 2, "params": {"pp": 1}, "shows": False, "mechanism": "clean", "gap": 0.0, "sentence": "clean"},
        {"ranks": 4, "params": {"pp": 1}, "shows": True, "mechanism": "mislabeled", "gap": 2.0, "sentence": "x"},
        {"ranks": 8, "params": {"pp": 1}, "shows": False, "mechanism": "unsupported", "gap": float("nan"),
         "sentence": "y"},
    ])
    fig = wb.viz.sweep_view(t)
    z = fig.data[0].z
    assert list(z[0]) == [0, 1, 0.5] and "mislabeled<br>gap 2" in fig.data[0].text[0][1]


def test_a_sweep_with_an_unknown_parameter_fails_before_any_engine():
    with pytest.raises(WorkbenchError, match="unknown parameter"):
        wb.sweep(threshold, ranks=[2], grid={"nope": [1]})
