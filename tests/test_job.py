"""Capture inside the user's own job (``workbench.job``): real scripts under real torchrun (gloo, CPU).

The FSDP2 non-persistent-buffer job must read, from its shards, exactly what the live session of
the same code says (the recorded catalogue bundle's diagnosis); the uneven eval loop must hang in
a mismatched pair of collectives, and its shards, read while it hangs and after the test kills it,
must name both calls and who waits in which. Problems with the shards (a missing rank, another
job's shard, ranks that disagree on a point's name) are one line each and the rest still opens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jobrun
import pytest
from conftest import free_port

import workbench as wb
import workbench.job as wj
from workbench.postmortem import shards

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FIXTURE = ROOT / "fixtures" / "bundles" / "fsdp2-nonpersistent-buffer-sync.wbundle"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_CAPTURE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def torchrun(script: str, out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    run = jobrun.run([*TORCHRUN, str(EXAMPLES / script), str(out), *args], out, timeout=timeout, env=_env(),
                     cwd=out.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("job") / "fsdp2"
    torchrun("fsdp2_buffers_job.py", out)
    return out


def test_fsdp2_job_reads_as_the_live_session_of_the_same_code(fsdp2_run, tmp_path):
    recorded = wb.load(FIXTURE)
    live = recorded.bug.diagnose()
    b = wb.load(fsdp2_run)  # the directory of shards, as any bundle
    assert b.problems == [] and recorded.problems == []
    rec = b.bug
    assert rec.steps == ["load", "shard", "materialize", "load_state_dict", "sync_buffers", "forward"]
    assert rec.manifest["ranks"] == 2 and rec.manifest["backend"] == "gloo"
    assert rec.manifest["job"]["launcher"] == "torchrun"
    d = rec.diagnose()
    assert (d.mechanism, d.sentence) == (live.mechanism, live.sentence)
    assert "`inv_freq`, `original_inv_freq` on ranks 0,1 were never written after materialisation" in d.sentence
    # the ledger holds the job's own calls, at the script's own lines, under the points they led to
    led = rec.ledger
    assert set(led["state"]) == {"completed"}
    sync = led[led["step"] == "sync_buffers"]
    assert len(sync) == 2 * 2 and set(sync["op"]) == {"broadcast"}  # inv_freq, original_inv_freq on 2 ranks
    assert sync["user_frame"].str.contains("fsdp2_buffers_job.py").all()

    # the command line: the story, the page, and a merged bundle that opens to the same story
    html, merged = tmp_path / "job.html", tmp_path / "job.wbundle"
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "report", str(fsdp2_run), "-o", str(html),
                          "--bundle", str(merged)], capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr
    assert f"diagnosis: {live.sentence}" in out.stdout
    assert "never written after materialisation" in html.read_text()
    again = wb.load(merged).bug
    assert again.diagnose().sentence == live.sentence
    assert str(fsdp2_run) not in merged.read_bytes().decode("latin-1")  # machine paths scrubbed


LEDGER_COLUMNS = ["rank", "step", "group", "seq", "op", "dtypes", "shapes", "state", "user_frame", "caller",
                  "library_frame", "via", "bucket", "send", "recv"]


def test_the_ledger_around_calls_only_records_what_the_full_one_does(fsdp2_run, tmp_path):
    """``ledger="calls"`` (the default: no dispatch mode between collectives): the same rows, call for call, as the
    full ledger (``WORKBENCH_CAPTURE_LEDGER=full``)."""
    out = tmp_path / "full"
    run = jobrun.run([*TORCHRUN, str(EXAMPLES / "fsdp2_buffers_job.py"), str(out)], out, timeout=300,
                     env={**_env(), "WORKBENCH_CAPTURE_LEDGER": "full"}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    full, calls = wb.load(out).bug, wb.load(fsdp2_run).bug
    assert json.loads((fsdp2_run / "rank0" / shards.MANIFEST).read_text())["ledger"] == "calls"
    assert json.loads((out / "rank0" / shards.MANIFEST).read_text())["ledger"] is True
    a, b = full.ledger[LEDGER_COLUMNS].reset_index(drop=True), calls.ledger[LEDGER_COLUMNS].reset_index(drop=True)
    assert len(a) > 20 and a.equals(b)
    assert calls.diagnose().sentence == full.diagnose().sentence


def test_torch_compile_compiles_under_the_calls_ledger_only(tmp_path, monkeypatch):
    import torch
    import torch._dynamo

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "WORKBENCH_CAPTURE", "WORKBENCH_CAPTURE_LEDGER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORKBENCH_JOB_ID", "compile")
    graphs = {}
    for ledger in (True, "calls"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with wj.capture(tmp_path / str(ledger), ledger=ledger, poison=False):
            torch.compile(torch.nn.Linear(4, 4), backend="eager")(torch.randn(2, 4))
        graphs[ledger] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == {True: 0, "calls": 1}  # the dispatch mode makes dynamo run the module eagerly


def test_the_fixed_job_is_clean(tmp_path):
    out = tmp_path / "fixed"
    torchrun("fsdp2_buffers_job.py", out, "--fix")
    d = wb.load(out).bug.diagnose()
    assert d.clean, d.sentence


def _open_calls(out: Path) -> dict[int, str]:
    try:
        rec, _ = shards.read(out)
    except Exception:
        return {}
    led = rec.ledger
    if not len(led):
        return {}
    open_ = led[led["state"] == "started"]
    return {int(r.rank): str(r.op) for r in open_.itertuples()}


def _wait(cond, proc, what: str, limit: float = 240.0) -> None:
    """Wait for a state the job reaches (not for a time): the limit only bounds a broken run."""
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() - t0 < limit, f"no {what} after {limit:.0f} s"
        time.sleep(0.2)


@pytest.mark.parametrize("ledger", ["1", "calls"])
def test_a_hung_job_names_the_stuck_calls_and_who_waits(tmp_path, ledger):
    out = tmp_path / "eval"
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen([*TORCHRUN, str(EXAMPLES / "uneven_eval_job.py"), str(out), "--debug-server"], stdout=log,
                            stderr=subprocess.STDOUT, env={**_env(), "WORKBENCH_CAPTURE_LEDGER": ledger}, cwd=tmp_path,
                            start_new_session=True)
    pids: list[int] = []
    try:
        # both ranks inside a call that can never pair: rank 0 all-gathers its third batch's
        # parameters, rank 1 (two batches) all-reduces the loss
        _wait(lambda: _open_calls(out) == {0: "all_gather_into_tensor", 1: "all_reduce"}, proc,
              "stuck call in both ranks' shards")
        pids = [json.loads((shards.rank_dir(out, r) / shards.MANIFEST).read_text())["pid"] for r in (0, 1)]
        # the job runs PyTorch's debug-server workers: the capture's handler answers there while it hangs
        asked = wj.ask_all(out)
        assert {r: [c["op"] for c in a["open_calls"]] for r, a in asked.items()} == {
            0: ["all_gather_into_tensor"], 1: ["all_reduce"]}, asked
        assert asked[1]["points"] == ["build", "shard"] and asked[1]["latest"]["point"] == "shard"
        # ... and `workbench report` reads the whole job through them (shards on node-local disks)
        urls = [json.loads((shards.rank_dir(out, r) / shards.MANIFEST).read_text())["debug_server"] for r in (0, 1)]
        cli = subprocess.run([sys.executable, "-m", "workbench.cli", "report", ",".join([*urls, "http://127.0.0.1:9"]),
                              "-o", str(tmp_path / "live.html")], capture_output=True, text=True, timeout=120,
                             env=_env())
        assert cli.returncode == 0, cli.stderr
        assert "rank 0 hung in all_gather_into_tensor" in cli.stdout and "rank 1 hung in all_reduce" in cli.stdout
        assert cli.stderr.count("debug server: no answer from http://127.0.0.1:9") == 1
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)  # faulthandler: every thread's stack into the rank's stacks.txt
        _wait(lambda: all("uneven_eval_job.py" in (shards.rank_dir(out, r) / shards.STACKS).read_text()
                          for r in (0, 1)), proc, "stacks from both ranks")
        live = wb.load(out).bug.diagnose()  # read while the job hangs
    finally:
        # both ranks stopped before either is killed: a rank killed first let its peer's gloo call fail, and that
        # rank recorded the failure before its own kill came (seen once in a fresh clone's run, 2026-11-30)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        log.close()
    b = wb.load(out)  # and after the kill: the same story
    rec = b.bug
    d = rec.diagnose()
    assert d.sentence == live.sentence
    assert d.mechanism == "collective-mismatch", d.sentence
    s = d.sentence
    assert "rank 0: all_gather_into_tensor" in s and "rank 1: all_reduce" in s and "float32 [2] 8 B" in s
    assert "uneven_eval_job.py:" in s  # the script's own lines, not the library's
    assert "in step `evaluate`" in s  # the point the ranks were on their way to (declared by the job)
    assert f"rank 0 hung in all_gather_into_tensor #{d.call['seq']}" in s or "rank 0 hung in all_gather" in s
    assert "rank 1 hung in all_reduce" in s and shards.STILL_INSIDE in s
    hang = rec.manifest["hangs"][0]
    assert set(hang["stuck"]) == {"0", "1"} and "all_reduce" in hang["stuck"]["1"]
    assert all("uneven_eval_job.py" in hang["stacks"][r] for r in ("0", "1"))
    head = hang["message"].splitlines()[0]
    assert "did not finish on every rank" in head and shards.STILL_INSIDE in head and "strict" not in head
    assert "uneven_eval_job.py" in wb.viz.hang_view(hang).to_html(include_plotlyjs=False)
    # everything the ranks reached before the hang is there
    assert rec.steps[:2] == ["build", "shard"] and set(rec.tensors["rank"]) == {0, 1}


def test_a_rank_that_raises_is_an_event_and_the_waiting_rank_is_named(tmp_path):
    """Rank 1 raises in a forward (sys.excepthook under torchrun); rank 0, inside the next all-gather, is
    released by the lost connection. Both exceptions are on disk before the processes end."""
    out = tmp_path / "bad"
    run = jobrun.run([*TORCHRUN, str(EXAMPLES / "uneven_eval_job.py"), str(out), "--bad-batch"], out, timeout=300,
                     env=_env(), cwd=tmp_path)
    assert run.returncode != 0
    rec = wb.load(out).bug
    ev = rec.events.set_index("rank")
    assert ev.loc[1, "error"] == "RuntimeError" and "mat1 and mat2 shapes" in ev.loc[1, "message"]
    assert "uneven_eval_job.py" in ev.loc[1, "traceback"]
    assert rec.manifest["job"]["status"] == {"0": "raised", "1": "raised"}
    d = rec.diagnose()  # the raise is the cause and leads; the parted all-gather is what it left
    assert d.sentence.startswith("rank 1 raised RuntimeError at examples/uneven_eval_job.py:"), d.sentence
    assert "mat1 and mat2 shapes" in d.sentence and "it left rank 0 waiting: rank 1 never issued group 0 call #" \
        in d.sentence and "that rank 0 issued" in d.sentence, d.sentence
    assert "all_gather_into_tensor" in d.sentence and "uneven_eval_job.py:" in d.sentence



def test_a_balanced_eval_job_ends_clean_and_its_ranks_agree_on_a_job_id(tmp_path):
    """torchrun's default static rendezvous names every run "none": the ranks then agree on an id through
    the process group's store, so a shard left by an earlier run is told apart."""
    out = tmp_path / "balanced"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(EXAMPLES / "uneven_eval_job.py"), str(out), "--balanced"]
    run = jobrun.run(cmd, out, timeout=300, env=_env(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rec = wb.load(out).bug
    assert rec.steps == ["build", "shard", "evaluate"] and rec.manifest["hangs"] == []
    assert rec.diagnose().clean
    docs = [json.loads((shards.rank_dir(out, r) / shards.MANIFEST).read_text()) for r in (0, 1)]
    assert {d["status"] for d in docs} == {"finished"}
    assert docs[0]["job"] == docs[1]["job"] and docs[0]["job"].startswith("job-")


# -- shards that do not fit: one line each, the rest opens ------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_missing_rank_is_one_line(fsdp2_run, tmp_path):
    out = _copy(fsdp2_run, tmp_path / "missing")
    shutil.rmtree(out / "rank1")
    b = wb.load(out)
    assert b.problems == ["rank 1 of 2 left no shard of job " + b.bug.manifest["job"]["id"]
                          + ": no rows for them (the rank never reached capture, or wrote elsewhere)"]
    assert set(b.bug.tensors["rank"]) == {0} and b.bug.manifest["devices"]["1"] == "no shard"
    assert "never written after materialisation" in b.bug.diagnose().sentence
    cli = subprocess.run([sys.executable, "-m", "workbench.cli", "report", str(out), "-o", str(tmp_path / "m.html")],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert cli.returncode == 0 and cli.stderr.strip() == f"workbench: {out}: {b.problems[0]}", cli.stderr
    merged = wb.load(wj.merge(out, tmp_path / "missing.wbundle")).bug  # the lines travel in the bundle
    assert merged.manifest["problems"] == b.problems and merged.diagnose().sentence == b.bug.diagnose().sentence


def test_a_shard_of_another_job_is_left_out(fsdp2_run, tmp_path):
    out = _copy(fsdp2_run, tmp_path / "other")
    stale = out / "rank2"
    shutil.copytree(out / "rank1", stale)  # a leftover of an earlier 3-rank run in the same directory
    doc = json.loads((stale / shards.MANIFEST).read_text())
    doc.update(rank=2, world_size=3, job="torchrun-earlier")
    (stale / shards.MANIFEST).write_text(json.dumps(doc))
    b = wb.load(out)
    assert len(b.problems) == 1 and b.problems[0].startswith("rank2 is a shard of another job (torchrun-earlier;")
    assert b.bug.manifest["ranks"] == 2 and set(b.bug.tensors["rank"]) == {0, 1}


def test_ranks_that_disagree_on_a_point_name(fsdp2_run, tmp_path):
    out = _copy(fsdp2_run, tmp_path / "names")
    pts = out / "rank1" / shards.POINTS
    lines = [json.loads(x) for x in pts.read_text().splitlines()]
    for x in lines:
        if x.get("point") == "sync_buffers":
            x["point"] = "sync"
    pts.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "point", "poi')  # and a cut line
    b = wb.load(out)
    assert b.problems == ["rank1/points.jsonl: 1 line(s) unreadable (cut by a kill?): skipped",
                          "the ranks disagree on point 4's name: rank 0 'sync_buffers'; rank 1 'sync' "
                          "(read as 'sync_buffers'; the rows are kept by position)"]
    assert b.bug.steps[4] == "sync_buffers" and b.bug.diagnose().mechanism == wb.load(FIXTURE).bug.diagnose().mechanism


def test_no_shard_at_all_is_one_error(tmp_path):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / shards.MANIFEST).write_text("{not json")
    with pytest.raises(wb.BundleError, match="no readable shard"):
        wb.load(tmp_path)


# -- in this process: durability per point, exceptions, the off switch ----------------------------
def test_a_point_is_on_disk_when_it_returns_and_an_exception_is_a_line(tmp_path, monkeypatch):
    import torch

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "WORKBENCH_CAPTURE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORKBENCH_JOB_ID", "test-job")
    cap = wj.capture(tmp_path / "one")
    try:
        with torch.device("meta"):
            model = torch.nn.Linear(16, 8)
        model.to_empty(device="cpu")
        info = cap.point("materialize", model=model, loss=torch.tensor(1.5))
        assert info["rows"] == 3 and info["bytes"] > 0
        # still open, nothing closed or flushed by us: the line is on disk already
        line = json.loads((tmp_path / "one" / "rank0" / shards.POINTS).read_text().splitlines()[0])
        assert line["point"] == "materialize" and len(line["tensors"]) == 2 and len(line["outputs"]) == 1
        try:
            raise ValueError("boom in the job")
        except ValueError as exc:
            cap._excepthook(ValueError, exc, exc.__traceback__)
    finally:
        cap.close()
    rec = wb.load(tmp_path / "one").bug
    t = rec.tensors
    assert (t["poisoned"] == t["numel"]).all() and set(t["written"]) == {"never written"}
    ev = rec.events
    assert list(ev["step"]) == ["after materialize"] and ev["error"].iloc[0] == "ValueError"
    assert rec.manifest["job"]["id"] == "test-job"
    assert json.loads((tmp_path / "one" / "rank0" / shards.MANIFEST).read_text())["status"] == "raised"
    # the capture gave back what it patched
    assert torch.nn.Module.to_empty.__name__ == "to_empty"


def test_capture_off_is_a_no_op(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("WORKBENCH_CAPTURE", "0")
    cap = wj.capture(tmp_path / "off")
    assert not cap.enabled and cap.point("x", model=torch.nn.Linear(2, 2)) is None
    monkeypatch.delenv("WORKBENCH_CAPTURE")
    assert not wj.capture(tmp_path / "off", enabled=False).enabled
    assert not (tmp_path / "off").exists()


def test_importing_the_job_side_pulls_no_client():
    code = ("import sys, workbench.job as wj; import torch; c = wj.capture(sys.argv[1], enabled=True); "
            "c.point('p', model=torch.nn.Linear(2, 2)); c.close(); "
            "print(sorted(m for m in ('pandas', 'ipyparallel', 'plotly', 'workbench.live') if m in sys.modules))")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, timeout=120,
                             env={**_env(), "WORKBENCH_JOB_ID": "x"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_srun_sets_rank_world_and_job(monkeypatch):
    from workbench.job import engine
    from workbench.job import shard as c

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "WORKBENCH_JOB_ID",
              "MASTER_PORT", "SLURM_TASKS_PER_NODE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")  # two nodes of four
    monkeypatch.setenv("MASTER_ADDR", "10.11.12.13")  # rank 0's node, as the job's own script exports it
    assert c.launcher_env() == {"launcher": "srun", "rank": 5, "world_size": 8, "local_rank": 1,
                                "local_world_size": 4, "master_addr": "10.11.12.13", "master_port": 0}
    assert c._launcher_job() == "slurm-4242.0"
    # the breakpoint's controller reads the same launcher: a job on two nodes is not served on loopback
    assert engine._controller_ip() == "10.11.12.13"
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8")
    assert engine._controller_ip() == "127.0.0.1"
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("RANK", "2")  # torchrun inside an allocation: its own ranks win
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert c.launcher_env()["rank"] == 2 and c.launcher_env()["launcher"] == "torchrun"


def test_a_rerun_keeps_the_run_before_and_repeated_points_are_numbered(tmp_path, monkeypatch):
    import torch

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "WORKBENCH_CAPTURE"):
        monkeypatch.delenv(k, raising=False)
    model = torch.nn.Linear(4, 4)
    for job in ("first", "second"):
        monkeypatch.setenv("WORKBENCH_JOB_ID", job)
        with wj.capture(tmp_path / "runs") as cap:
            for _ in range(3):
                cap.point("step", model=model)
    now, before = wb.load(tmp_path / "runs").bug, wb.load(tmp_path / "runs" / "previous").bug
    assert now.manifest["job"]["id"] == "second" and before.manifest["job"]["id"] == "first"
    assert now.steps == ["step", "step (2)", "step (3)"]


SRUN_SCRIPT = '''
import os, sys
import torch, torch.distributed as dist
import workbench.job as wj
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank, world_size=world)
cap = wj.capture(sys.argv[1])
model = torch.nn.Linear(8, 8)
dist.broadcast(model.weight.data, src=0)  # the bias is forgotten: each rank keeps its own random one
cap.point("synced", model=model)
cap.close()
dist.destroy_process_group()
'''


def test_under_srun_the_ranks_and_the_job_come_from_slurm(tmp_path):
    """What srun gives each task: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_ID (no RANK)."""
    script = tmp_path / "train.py"
    script.write_text(SRUN_SCRIPT)
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(SLURM_NTASKS="2", SLURM_JOB_ID="77", SLURM_STEP_ID="0", PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "runs")], stderr=subprocess.PIPE, text=True,
                              env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    rec = wb.load(tmp_path / "runs").bug
    assert rec.manifest["job"]["id"] == "slurm-77.0" and rec.manifest["job"]["launcher"] == "srun"
    assert rec.steps == ["synced"] and set(rec.ledger["rank"]) == {0, 1} and set(rec.ledger["op"]) == {"broadcast"}
    d = rec.diagnose()
    assert d.mechanism == "diverged" and d.sentence.startswith("`bias` on rank 1 differs"), d.sentence


def test_poison_to_empty_only_leaves_the_allocators_alone(tmp_path, monkeypatch):
    import torch

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "WORKBENCH_CAPTURE", "WORKBENCH_CAPTURE_LEDGER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORKBENCH_JOB_ID", "poison")
    with wj.capture(tmp_path / "p", poison="to_empty", ledger="calls") as cap:
        assert torch._C._is_torch_function_mode_enabled() is False  # no mode between points at all
        with torch.device("meta"):
            model = torch.nn.Linear(8, 8)
        model.to_empty(device="cpu")
        scratch = {"buffer": torch.empty(64)}
        cap.point("materialize", model=model, scratch=scratch)
    t = wb.load(tmp_path / "p").bug.tensors.set_index("name")
    assert t.loc["model.weight", "poisoned"] == 64 and t.loc["model.weight", "written"] == "never written"
    assert t.loc["scratch.buffer", "poisoned"] == 0
    with pytest.raises(ValueError, match="poison must be"):
        wj.capture(tmp_path / "q", poison="yes")


def test_declared_points_name_where_a_job_stopped(tmp_path, monkeypatch):
    import torch

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "WORKBENCH_CAPTURE", "WORKBENCH_CAPTURE_LEDGER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORKBENCH_JOB_ID", "plan")
    with wj.capture(tmp_path / "plan", points=["build", "train", "save"]) as cap:
        cap.point("build", model=torch.nn.Linear(2, 2))
    rec = wb.load(tmp_path / "plan").bug
    assert rec.steps == ["build"] and rec.manifest["steps"] == ["build", "train", "save"]
    assert rec.diagnose().sentence.startswith("clean so far: 1 of 3 steps ran")
