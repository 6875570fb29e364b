"""Capture you leave on (issue 46): the defaults keep no mode on the job's ops, see what C++ issues, and let
``torch.compile`` compile. Real torchrun (2 ranks, gloo, CPU), one job a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jobrun
import pytest

import workbench as wb

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "jobs"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(script: str, out: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKBENCH_CAPTURE", "TORCH_FR", "TORCH_NCCL"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra_env)
    run = jobrun.run([*TORCHRUN, str(JOBS / script), str(out), *args], out, timeout=300, env=env, cwd=out.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@pytest.mark.parametrize("writer", ["inline", "thread"])
def test_ddp_reducer_all_reduces_are_in_the_default_record_with_no_mode_between_points(tmp_path, writer):
    """``thread``: each point finished on the capture's writer thread, as on a GPU job (``job/writer.py``): Flight
    Recorder read after the job went on, its calls still under the point they led to."""
    out = tmp_path / "ddp"
    _run("ddp_capture_job.py", out, WORKBENCH_CAPTURE_WRITER=writer)  # exits 3 where a mode sits on the job's stacks
    rec = wb.load(out).bug
    led = rec.ledger
    assert json.loads((out / "rank0" / "shard.json").read_text())["ledger"] == "calls"
    # every step's reducer all-reduce, on both ranks, under the point it led to, at the script's backward line
    ar = led[led["op"] == "all_reduce"]
    assert sorted(zip(ar["rank"], ar["step"])) == [(r, f"step{i}") for r in (0, 1) for i in range(3)]
    assert ar["c10d_op"].eq("gloo:all_reduce").all()  # Flight Recorder's entry: no Python function issued it
    assert ar["user_frame"].str.contains("ddp_capture_job.py").all()
    backward = next(i for i, line in enumerate((JOBS / "ddp_capture_job.py").read_text().splitlines(), 1)
                    if "# BACKWARD" in line)
    assert ar["user_frame"].str.contains(f"ddp_capture_job.py:{backward} ").all()
    assert set(ar["state"]) <= {"completed", "issued"} and set(ar["dtypes"]) == {"float32"}
    # one numbering for what Python issued and what C++ did: the ranks' n-th calls line up, nothing missing
    for r in (0, 1):
        seqs = sorted(led[(led["rank"] == r) & (led["group"] == "0")]["seq"])
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 3 + 3
    lines = [json.loads(x) for x in (out / "rank0" / "rank0.jsonl").read_text().splitlines()]
    assert {x.get("source") for x in lines if x.get("ev") == "start" and x["op"] == "all_reduce"} == {"flight_recorder"}
    d = rec.diagnose()
    assert d.clean, d.sentence


def test_a_compiled_model_compiles_under_the_defaults_and_reads_as_eager(tmp_path):
    out = tmp_path / "compiled"
    _run("compiled_capture_job.py", out)
    for r in (0, 1):
        counted = json.loads((out / "compiled" / f"dynamo{r}.json").read_text())
        assert counted["unique_graphs"] >= 1 and counted["frames_ok"] >= 1, counted  # dynamo captured a graph
        assert counted["graph_breaks"] == 0, counted
    eager, compiled = wb.load(out / "eager").bug.diagnose(), wb.load(out / "compiled").bug.diagnose()
    assert "`scale` on ranks 0,1 was never written after materialisation" in eager.sentence, eager.sentence
    assert (compiled.mechanism, compiled.sentence) == (eager.mechanism, eager.sentence)


def test_a_point_rewrites_the_manifest_at_most_once_a_second_and_the_points_file_names_the_last(tmp_path, monkeypatch):
    """Left on, a point every step: the manifest (the whole document, every point's name) is rewritten by the first
    point and then at most every ``MANIFEST_EVERY_S``, while each point's line is written at once; the last point
    a dead rank reached is read from the points file (``shard_format.last_point``), and the close writes them all."""
    import torch
    from torch import nn

    import workbench.job as wj
    from workbench.job import capture_points, shard
    from workbench.rank import shard_format

    for k in ("WORKBENCH_CAPTURE", "WORKBENCH_CAPTURE_PID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(shard, "_SAID", set())
    monkeypatch.setattr(capture_points, "MANIFEST_EVERY_S", 1e9)  # no second passes: the verdict is not the box's
    cap = wj.capture(tmp_path / "cap")
    d = shard_format.rank_dir(tmp_path / "cap", 0)
    model = nn.Linear(3, 2)
    for i in range(5):
        with torch.no_grad():
            model.weight.add_(1.0)
        cap.point(f"step{i}", model=model)
        cap.flush()
        assert shard_format.last_point(d) == f"step{i}"
        assert json.loads((d / shard_format.MANIFEST).read_text())["points"] == ["step0"]  # the first point's
    with open(d / shard_format.POINTS, "a") as f:
        f.write('{"kind": "exception", "type": "X"}\n{"kind": "point", "point": "half')  # killed mid-line
    assert shard_format.last_point(d) == "step4"
    assert shard_format.last_point(tmp_path) is None  # no points file
    cap.close()
    assert json.loads((d / shard_format.MANIFEST).read_text())["points"] == [f"step{i}" for i in range(5)]
