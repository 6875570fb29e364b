"""Capture with no line of the user's code: ``workbench job DIR -- <launcher> ...`` (``workbench/job/hooks.py``).

Unmodified scripts run under the wrapper and their reports tell what the same code with manual points
tells (the point names are the calls' own: ``to_empty`` where the manual script said ``materialize``): the
FSDP2 non-persistent-buffer job, the headline incident's FSDP1 ``sync_module_states`` init, a rank that
raises (attachable post mortem), a clean job (the same exit status and stdout as without the wrapper, the
launcher's own answer to SIGTERM), ``accelerate launch`` of a ``prepare`` script and an HF ``Trainer``.
Without ``WORKBENCH_CAPTURE`` the site hook imports nothing of the workbench. Each job runs once per module.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jobrun
import psutil
import pytest

import workbench as wb
import workbench.job as wj
from workbench.analysis import collectives
from workbench.job import hooks

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "jobs"
SITE = ROOT / "workbench" / "job" / "site"
FIXTURE = ROOT / "fixtures" / "bundles" / "fsdp2-nonpersistent-buffer-sync.wbundle"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
JOB = [sys.executable, "-m", "workbench.cli", "job"]
ENVS = ("WORKBENCH_CAPTURE", "WORKBENCH_JOB_ID", "WORKBENCH_CAPTURE_LEDGER", hooks.ENV_PID, hooks.ENV_EVERY,
        hooks.ENV_POINTS, hooks.ENV_ATTACH, hooks.ENV_POISON, hooks.ENV_DEADLINE)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENVS}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]), **extra})
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    """A job, plain or under ``workbench job`` (``jobrun.run``: again only where it met torch's exit abort; a rerun
    under ``workbench job`` starts from an empty capture folder)."""
    fresh = cmd[len(JOB)] if cmd[:len(JOB)] == JOB and len(cmd) > len(JOB) else None
    return jobrun.run(cmd, fresh, timeout=timeout, env=env or _env(), cwd=cwd)


def _plain(script: Path, out: Path) -> Path:
    """``script`` without the workbench's lines (every line that names ``cap`` or ``wj``): the same job."""
    lines = [ln for ln in script.read_text().splitlines() if not re.search(r"\b(cap|wj)\b", ln)]
    out.write_text("\n".join(lines) + "\n")
    return out


def _points(out: Path, rank: int = 0) -> list[str]:
    return [json.loads(ln).get("point") for ln in (out / f"rank{rank}" / "points.jsonl").read_text().splitlines()
            if json.loads(ln).get("kind") == "point"]


def _same_code(sentence: str) -> str:
    """A sentence with the script's file and line left out (the plain copy is shorter: its lines moved)."""
    return re.sub(r"[\w./-]+\.py:\d+", "<script line>", sentence)


def _same_story(sentence: str) -> str:
    """``_same_code``, and which rank's gloo timeout fired first left out: both ranks wait out the same timeout, so
    one reads "timed out in" and its peer, cut off, "failed in", in whichever order their timers ran in that
    run (two runs of the same job can differ there and nowhere else)."""
    return re.sub(r"\b(timed out|failed) in\b", "ended in", _same_code(sentence))


def _says(run: subprocess.CompletedProcess) -> str:
    return run.stdout[-3000:] + run.stderr[-3000:]


# -- the site hook and the hooks in this process (no launcher) ----------------------------------------
def test_without_the_variable_the_site_hook_imports_nothing_and_chains_the_jobs_own(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITE'] = 'ran'\n")
    probe = ("import os, sys; print(sorted(m for m in sys.modules if m.startswith('workbench')), "
             "os.environ.get('OWN_SITE'), 'torch' in sys.modules)")
    path = os.pathsep.join([str(SITE), str(own), str(ROOT)])
    for value in (None, "0", "off"):
        env = {k: v for k, v in _env(PYTHONPATH=path, RANK="0", WORLD_SIZE="1").items() if k != "WORKBENCH_CAPTURE"}
        if value is not None:
            env["WORKBENCH_CAPTURE"] = value
        got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
        assert got.returncode == 0 and got.stdout.split() == ["[]", "ran", "False"], (value, got.stdout, got.stderr)
    # set, in a process that is no rank (torchrun's own agent has no RANK): armed nothing, wrote nothing
    env = _env(PYTHONPATH=path, WORKBENCH_CAPTURE=str(tmp_path / "cap"))
    got = subprocess.run([sys.executable, "-c", "import torch; " + probe], capture_output=True, text=True, env=env,
                         timeout=120)
    assert got.returncode == 0 and "ran True" in got.stdout and not (tmp_path / "cap").exists(), got.stderr


def test_which_process_is_a_rank():
    rank = {"RANK": "1", "WORLD_SIZE": "2"}
    assert hooks.is_rank(rank, ["python", "train.py"], 10)
    assert hooks.is_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, ["python", "train.py"], 10)
    assert not hooks.is_rank({}, ["python", "train.py"], 10)
    assert not hooks.is_rank(rank, ["python", "-m", "torch.distributed.run", "train.py"], 10)  # a launcher
    assert not hooks.is_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, ["/v/bin/torchrun", "train.py"], 10)
    assert not hooks.is_rank({**rank, hooks.ENV_PID: "9"}, ["python", "train.py"], 10)  # a rank's own worker
    assert hooks.is_rank({**rank, hooks.ENV_PID: "10"}, ["python", "-u", "train.py"], 10)


def test_the_automatic_points_beside_the_users_own_in_one_capture(tmp_path, monkeypatch):
    """In this process: the calls return what they returned, raise what they raised, keep their signatures,
    and each leaves its point (a nested or partial call none); the script's own capture is the same one."""
    import torch
    from torch import nn


    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", *ENVS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORKBENCH_CAPTURE", str(tmp_path / "auto"))
    monkeypatch.setenv("WORKBENCH_JOB_ID", "in-process")
    monkeypatch.setenv(hooks.ENV_EVERY, "2")
    monkeypatch.setenv(hooks.ENV_ATTACH, "off")
    def signatures() -> dict[str, list]:
        return {n: [(p.name, p.kind, p.default) for p in inspect.signature(getattr(nn.Module, n)).parameters.values()]
                for n in ("to_empty", "load_state_dict")}

    before, found = signatures(), nn.Module.to_empty  # a live session's tracker may be on: close leaves it
    h = hooks.start()
    try:
        assert h is not None and h.cap.root == tmp_path / "auto"
        cap = wj.capture(tmp_path / "elsewhere")
        assert cap is h.cap  # the user's own capture line: the same capture, its points beside the automatic ones
        assert signatures() == before
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        assert model.to_empty(device="cpu") is model
        model[0].to_empty(device="cpu", recurse=False)  # a piece of someone else's materialisation: no point
        cap.point("mine", model=model)

        class Receiver(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.zeros(2))

            def load_weights(self, weights):
                for _, t in weights:
                    self.w.data.copy_(t)
                return {"w"}

        got = Receiver().load_weights(iter([("w", torch.ones(2))]))
        assert got == {"w"}
        with pytest.raises(RuntimeError, match="size mismatch"):  # raised as it was; no point
            model.load_state_dict({"0.weight": torch.zeros(3, 3)}, strict=False)
        result = model.load_state_dict({k: torch.ones_like(v) for k, v in model.state_dict().items()})
        assert result.missing_keys == [] and result.unexpected_keys == []
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
        assert h.errors == []
    finally:
        h.cap.close()
        h.uninstall()
    assert _points(tmp_path / "auto") == ["to_empty", "mine", "load_weights", "load_state_dict", "step1", "step2",
                                          "step4"]
    assert not (tmp_path / "elsewhere").exists()
    assert nn.Module.to_empty is found and "__init_subclass__" not in nn.Module.__dict__
    assert not getattr(nn.Module.load_state_dict, "__workbench_hook__", None)
    rows = wb.load(tmp_path / "auto").bug.tensors
    assert set(rows[rows["step"] == "step1"]["name"]) == {"model.0.weight", "model.0.bias", "model.1.weight",
                                                          "model.1.bias"}  # the module the optimizer steps


def test_the_command_line_says_what_is_wrong_in_one_line(capsys):
    from workbench import cli

    assert cli.main(["job", "--points"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in hooks.POINTS)
    for argv, says in ((["job", "runs/x"], "needs a directory and a command"),
                       (["job", "runs/x", "--points", "to_empty,warp", "--", "true"], "unknown point(s) warp"),
                       (["job", "runs/x", "--", "no-such-launcher-here"], "cannot run 'no-such-launcher-here'")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


# -- unmodified jobs under the wrapper -----------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero") / "fsdp2"
    run = _run([*JOB, str(out), "--", *TORCHRUN, str(ROOT / "examples" / "fsdp2_buffers_plain.py")], out.parent)
    assert run.returncode == 0, _says(run)
    return out


@pytest.mark.slow
def test_the_fsdp2_job_unmodified_reads_as_the_manual_points_do(fsdp2, tmp_path):
    live = wb.load(FIXTURE).bug.diagnose()  # the same code with manual points reads this (tests/test_job.py)
    rec = wb.load(fsdp2).bug
    assert rec.steps == ["fully_shard", "to_empty", "set_model_state_dict", "forward"]
    d = rec.diagnose()
    assert d.mechanism == live.mechanism
    assert d.sentence == live.sentence.replace("at step `materialize`", "at step `to_empty`"), d.sentence
    led = rec.ledger
    assert len(led) and led["user_frame"].str.contains("fsdp2_buffers_plain.py").all()  # never the hooks' frame
    report = _run([sys.executable, "-m", "workbench.cli", "report", str(fsdp2), "-o", str(tmp_path / "r.html")],
                  tmp_path, timeout=120)
    assert f"diagnosis: {d.sentence}" in report.stdout, report.stderr


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory) -> tuple[Path, Path]:
    """The FSDP1 job with its manual points, and the same job unmodified under the wrapper, side by side."""
    tmp = tmp_path_factory.mktemp("fsdp1")
    script = JOBS / "fsdp1_sync_job.py"
    plain = _plain(script, tmp / "fsdp1_sync_plain.py")
    manual, auto = tmp / "manual", tmp / "auto"
    procs = [subprocess.Popen([*TORCHRUN, str(script), str(manual), "--timeout", "15"], env=_env(), cwd=tmp,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
             subprocess.Popen([*JOB, str(auto), "--attach", "off", "--", *TORCHRUN, str(plain), "--timeout", "15"],
                              env=_env(), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    for p in procs:
        log = p.communicate(timeout=300)[0]
        assert p.returncode == 1, log[-3000:]  # rank 0 times out in its second broadcast, as the incident
    return manual, auto


@pytest.mark.slow
def test_the_fsdp1_sync_module_states_job_unmodified_reads_as_the_manual_points_do(fsdp1):
    manual, auto = (wb.load(p).bug for p in fsdp1)
    assert manual.steps[:3] == ["load", "cast", "wrap_fsdp1"]
    assert auto.steps[0] == "FullyShardedDataParallel"
    m, a = manual.diagnose(), auto.diagnose()
    assert "the ranks' collectives part at group 0 call #1 in step `wrap_fsdp1` (different dtypes)" in m.sentence
    assert _same_story(a.sentence) == _same_story(m.sentence).replace("`wrap_fsdp1`", "`FullyShardedDataParallel`")
    assert "(bucket 0 of _broadcast_coalesced, 2 tensors)" in a.sentence and "fsdp1_sync_plain.py:" in a.sentence
    notes = json.loads((fsdp1[1] / "rank1" / "points.jsonl").read_text().splitlines()[0])["notes"]
    assert notes == ["FullyShardedDataParallel(sync_module_states=True)"]


@pytest.mark.slow
def test_a_rank_that_raises_is_attachable_post_mortem_and_fails_as_without_the_wrapper(tmp_path):
    script = JOBS / "raise_job.py"
    plain = _plain(script, tmp_path / "raise_plain.py")
    manual = _run([*TORCHRUN, str(script), str(tmp_path / "manual")], tmp_path)
    auto = tmp_path / "auto"
    log = tmp_path / "auto.log"
    # asked for: its output goes to a file, and a run nobody watches does not wait for a notebook by default
    proc = subprocess.Popen([*JOB, str(auto), "--every", "1", "--attach", "post-mortem", "--attach-deadline", "120",
                             "--", *TORCHRUN, str(plain)],
                            env=_env(), cwd=tmp_path, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    cluster = None
    try:
        end = time.monotonic() + 240
        while not (auto / "attach.json").exists():
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.2)
        cluster = wb.connect(job=auto)
        pm = cluster.post_mortem
        assert pm["reason"] == "error" and pm["rank"] == 1
        assert pm["error"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
        assert "model.0.weight" in set(cluster.probe("model")["name"])
        assert cluster.resume()["by"] == "client"
        assert proc.wait(120) == manual.returncode == 1
    finally:
        if cluster is not None and cluster.alive:
            cluster.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert "[rank1]: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x6 and 8x8)" in log.read_text()
    m, a = wb.load(tmp_path / "manual").bug.diagnose(), wb.load(auto).bug.diagnose()
    assert m.sentence.startswith("rank 1 raised RuntimeError in step `step3`: mat1 and mat2"), m.sentence
    assert _same_code(a.sentence) == _same_code(m.sentence), (a.sentence, m.sentence)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("clean")
    script = str(JOBS / "clean_job.py")
    return {"tmp": tmp, "plain": _run([*TORCHRUN, script], tmp),
            "wrapped": _run([*JOB, str(tmp / "cap"), "--every", "2", "--", *TORCHRUN, script], tmp)}


@pytest.mark.slow
def test_a_clean_job_reads_clean_with_the_same_status_and_stdout(clean):
    plain, wrapped = clean["plain"], clean["wrapped"]
    assert plain.returncode == wrapped.returncode == 0, _says(wrapped)
    assert wrapped.stdout == plain.stdout and plain.stdout.count("loss") == 3
    out = clean["tmp"] / "cap"
    assert _points(out, 0) == _points(out, 1) == ["forward", "step1", "step2"]
    d = wb.load(out).bug.diagnose()
    assert d.clean, d.sentence
    # Clean as far as the points saw: the job's third step came after its last step point, and the sentence says so.
    assert "the capture's last step point is after optimizer step 2 of the 3 the job ran" in d.sentence, d.sentence
    assert "workbench" not in wrapped.stderr  # nothing said in the job's log


def _sigterm(cmd: list[str], tmp: Path, name: str) -> tuple[int, list[str]]:
    ready = tmp / f"{name}.ready"
    proc = subprocess.Popen([*cmd, "--wait", str(ready)], env=_env(), cwd=tmp, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        end = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < end, f"{name}: no ready file"
            time.sleep(0.2)
        cmdline = psutil.Process(proc.pid).cmdline()
        proc.send_signal(signal.SIGTERM)
        return proc.wait(120), cmdline
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.mark.slow
def test_sigterm_reaches_the_launcher_itself(tmp_path):
    script = str(JOBS / "clean_job.py")
    rc_plain, _ = _sigterm([*TORCHRUN, script], tmp_path, "plain")
    rc_wrapped, cmdline = _sigterm([*JOB, str(tmp_path / "cap"), "--", *TORCHRUN, script], tmp_path, "wrapped")
    assert "torch.distributed.run" in cmdline and "workbench.cli" not in cmdline  # the wrapper became the launcher
    assert rc_wrapped == rc_plain != 0


def test_a_job_no_launcher_gave_a_rank_says_it_captures_nothing(tmp_path):
    """``workbench job DIR -- python train.py`` and ``accelerate launch`` of one process (its ``--cpu`` without
    ``--multi_gpu``) run the job in a process no launcher gave a rank: it captured nothing and said nothing, and
    ``workbench report DIR`` read "no bundle". Now that process says why, in one line, at its exit (it might have
    joined a process group, which starts a capture); the exit status and stdout are the plain run's, and nothing is
    written."""
    script = tmp_path / "one.py"
    script.write_text("import torch\nprint('ok', torch.ones(2).sum().item())\n")
    one = ["accelerate", "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no"]
    for name, launch in (("python", [sys.executable]), ("accelerate", one)):
        out = tmp_path / name
        run = _run([*JOB, str(out), "--", *launch, str(script)], tmp_path)
        assert run.returncode == 0 and run.stdout.splitlines()[-1] == "ok 2.0", (name, _says(run))
        said = [ln for ln in run.stderr.splitlines() if ln.startswith("workbench:")]
        assert len(said) == 1 and "captured nothing: no launcher gave a process a rank" in said[0], (name, said)
        assert "torchrun --nproc-per-node 1" in said[0], (name, said)
        assert not out.exists(), name
    assert not hooks.rankless_job({}, ["python", "-c", "pass"], 10, 1)  # no launcher pid: not under workbench job
    assert hooks.rankless_job({hooks.config.ENV_LAUNCHER: "10"}, ["python", "train.py"], 10, 1)
    assert not hooks.rankless_job({hooks.config.ENV_LAUNCHER: "10"}, ["python", "-m", "torch.distributed.run"], 10, 1)
    assert not hooks.rankless_job({hooks.config.ENV_LAUNCHER: "10", "RANK": "0", "WORLD_SIZE": "1"},
                                  ["python", "train.py"], 10, 1)  # a rank: it captures
    assert not hooks.rankless_job({hooks.config.ENV_LAUNCHER: "7"}, ["python", "train.py"], 10, 7,
                                  ["bash", "run.sh"])  # a shell's child: a helper, maybe, before torchrun
    assert hooks.rankless_job({hooks.config.ENV_LAUNCHER: "7"}, ["python", "train.py"], 10, 7,
                              ["/v/bin/python", "/v/bin/accelerate", "launch", "train.py"])


@pytest.mark.slow
def test_accelerate_launch_of_a_prepare_script(tmp_path):
    out = tmp_path / "acc"
    launch = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]
    run = _run([*JOB, str(out), "--", *launch, str(JOBS / "accelerate_prepare.py")], tmp_path)
    assert run.returncode == 0, _says(run)
    assert run.stdout.count("loss") == 4
    assert _points(out, 0) == _points(out, 1) == ["forward", "step1"]
    d = wb.load(out).bug.diagnose()
    assert d.clean, d.sentence


@pytest.mark.slow
def test_an_hf_trainer_job(tmp_path):
    out = tmp_path / "trainer"
    run = _run([*JOB, str(out), "--", *TORCHRUN, str(JOBS / "hf_trainer.py")], tmp_path)
    assert run.returncode == 0 and "trained 3 steps" in run.stdout, _says(run)
    assert _points(out, 0) == _points(out, 1) == ["forward", "step1"]
    rec = wb.load(out).bug
    first = rec.outputs[rec.outputs["step"] == "forward"]
    assert {"loss", "logits"} <= set(first["name"])  # the Trainer's forward output, as outputs
    d = rec.diagnose()
    assert d.clean, d.sentence


@pytest.mark.slow
def test_a_point_one_rank_alone_took_pairs_the_others_by_name(tmp_path):
    """Rank 0 alone loads a checkpoint after the DDP wrap: its ``load_state_dict`` point has no peer, so pairing
    points by position read rank 1's ``forward`` as ``load_state_dict`` and cut its calls into the wrong steps, and
    the report said a rank "never issued" a call both ranks issued (found by hand, an Accelerate job). Paired by
    name, the calls line up and what is wrong is what the ranks hold: different weights from ``forward`` on."""
    script = str(JOBS / "rank0_loads_job.py")
    runs = {}
    for label, args in (("right", []), ("bug", ["--bug"])):
        out = tmp_path / label
        run = _run([*JOB, str(out), "--", *TORCHRUN, script, *args], tmp_path)
        assert run.returncode == 0 and run.stdout.count("loss") == 3, _says(run)
        runs[label] = wb.load(out)
    assert runs["right"].bug.diagnose().clean, runs["right"].bug.diagnose().sentence
    b = runs["bug"]
    assert b.problems == ["rank 0 took a point the others did not: 'load_state_dict' (point 0 of rank 0); the "
                          "points are paired by name"], b.problems
    assert b.bug.steps[:3] == ["load_state_dict", "forward", "step1"]
    t = b.bug.tensors
    assert set(t[t["step"] == "load_state_dict"]["rank"]) == {0}  # rank 1's forward is read as its forward
    assert collectives.first_divergence(b.bug.ledger) is None  # every call paired: both ranks issued them all
    d = b.bug.diagnose()
    assert not d.clean and d.step == "forward" and "never issued" not in d.sentence, d.sentence
    assert "rank 0 alone took the point `load_state_dict` (rank 1 never did): the ranks part there" in d.sentence


def test_a_job_that_raises_before_any_point_saw_its_weights_written_reads_as_the_raise(tmp_path):
    """The job's only point is the automatic one at ``to_empty``, which reads every tensor it made unwritten (as any
    is, right after materialisation); the job then writes them (``_init_weights``) and raises a ``TypeError`` of its
    own. Found by hand (a DeepSpeed script): the report led with "never written after materialisation ... still
    unwritten at the last step", a claim no point could back. The raise leads; the tensors are said as seen once."""
    out = tmp_path / "cap"
    run = _run([*JOB, str(out), "--", *TORCHRUN, str(JOBS / "raise_after_init_job.py")], tmp_path)
    assert run.returncode != 0 and "TypeError" in run.stderr, _says(run)
    r = wb.load(out)
    assert r.bug.steps[0] == "to_empty", r.bug.steps
    d = r.bug.diagnose()
    assert d.sentence.startswith("ranks 0,1 raised TypeError at jobs/raise_after_init_job.py:20"), d.sentence
    assert "never written after materialisation" not in d.sentence and "still unwritten" not in d.sentence
    assert ("were unwritten at step `to_empty`, the first point after their materialisation, and no later point "
            "looked at them: whether the job wrote them is not known") in d.sentence, d.sentence


def test_a_warning_from_inside_a_hooked_call_names_the_users_line_as_without_the_workbench(tmp_path):
    """torch warns with ``stacklevel=2`` to name the line that called it (DDP's ``broadcast_buffers``
    deprecation). The hooks' wrapper of ``DistributedDataParallel.__init__`` sits between: Lightning Fabric's DDP job
    printed "workbench/job/hooks.py:264: FutureWarning" where its plain run printed Fabric's own line. The job's
    stderr warnings are the plain run's, line for line."""
    script = JOBS / "warning_job.py"
    env = _env(PYTHONWARNINGS="default")  # the suite's "ignore" off: Python's own default, as a user's job has it
    plain = _run([*TORCHRUN, str(script)], tmp_path, env=env)
    wrapped = _run([*JOB, str(tmp_path / "cap"), "--every", "1", "--", *TORCHRUN, str(script)], tmp_path, env=env)
    assert plain.returncode == wrapped.returncode == 0, _says(wrapped)

    def warned(run: subprocess.CompletedProcess) -> list[str]:
        return sorted(ln for ln in run.stderr.splitlines() if "Warning:" in ln)

    if not warned(plain):
        pytest.skip("this torch does not warn at DistributedDataParallel(broadcast_buffers=True)")
    assert all(ln.startswith(f"{script}:") for ln in warned(plain)), warned(plain)
    assert warned(wrapped) == warned(plain), warned(wrapped)


@pytest.mark.slow
def test_ranks_a_script_starts_itself_are_captured(tmp_path):
    """Ranks no launcher started: the DDP tutorial's ``torch.multiprocessing.spawn`` and Lightning Fabric's own
    launcher (``python train.py`` with ``devices=2``: it starts rank 1 itself and gives no one ``RANK``). Each rank's
    rank reaches only its ``init_process_group`` call. Under ``workbench job`` such a job captured nothing, its
    report read "no bundle", and Fabric's first process said "captures nothing" while its loss was NaN. Now each
    rank's capture starts as it joins the group: the planted bug is named, and stdout is the plain run's."""
    port = str(_free_port())
    plain = _run([sys.executable, str(JOBS / "spawn_job.py"), port, "--bug"], tmp_path)
    out = tmp_path / "spawn"
    run = _run([*JOB, str(out), "--every", "1", "--", sys.executable, str(JOBS / "spawn_job.py"), port, "--bug"],
               tmp_path)
    assert run.returncode == plain.returncode == 0 and run.stdout == plain.stdout, _says(run)
    assert "captured nothing" not in run.stderr, _says(run)
    assert _points(out, 0) == _points(out, 1) == ["forward", "step1", "step2", "step3"], _says(run)
    d = wb.load(out).bug.diagnose()
    assert not d.clean and d.ranks == [1] and d.step == "step1", d.sentence
    assert "DDP replica" in d.sentence, d.sentence

    out = tmp_path / "side"  # a process of the job joins a group of one as its rank 0: rank 0's capture stays
    run = _run([*JOB, str(out), "--", sys.executable, str(JOBS / "spawn_job.py"), str(_free_port()), "--side",
                str(_free_port())], tmp_path)
    assert run.returncode == 0 and "side group 2.0" in run.stdout, _says(run)
    said = [ln for ln in run.stderr.splitlines() if ln.startswith("workbench:")]
    assert len(said) == 1 and "joined a group as rank 0, whose capture process" in said[0], _says(run)
    assert _points(out, 0) == _points(out, 1) == ["forward", "step1"] and not (out / "previous").exists(), _says(run)

    out = tmp_path / "fabric"
    run = _run([*JOB, str(out), "--", sys.executable, str(JOBS / "stack_lightning.py"), "--empty-init"], tmp_path)
    assert run.returncode == 0 and "captured nothing" not in run.stderr, _says(run)
    assert (out / "rank0").is_dir() and (out / "rank1").is_dir(), _says(run)
    d = wb.load(out).bug.diagnose()
    assert d.mechanism == "never-written" and d.step == "to_empty", d.sentence
    ev = d.evidence  # the modules without reset_parameters(), as under torchrun (test_stacks.py): no more, no fewer
    want = {"model.model.rotary_emb.inv_freq", "model.model.rotary_emb.original_inv_freq", "model.model.norm.weight",
            *(f"model.model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm",
                                                                            "post_attention_layernorm"))}
    assert set(ev[ev["step"] == "to_empty"]["what"]) == want, d.sentence


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
