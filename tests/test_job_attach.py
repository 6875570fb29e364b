"""A notebook attached to every rank of the user's own job at ``cap.breakpoint()``, then handed back.

Real torchrun (2 ranks, gloo, CPU) runs ``examples/breakpoint_job.py``: at its breakpoint every rank
serves as an ipyparallel engine; ``wb.connect(job=dir)`` attaches over the job's own group, probes
the model, changes a buffer on every rank and resumes: the script goes on and its result shows the
change. Without a client the ranks go on at the deadline. No test leaves a process behind: torchrun
runs in its own session and the whole session is killed at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import workbench as wb
from workbench.errors import ClusterError

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "breakpoint_job.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_CAPTURE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


class Job:
    """torchrun in a session of its own: everything it started goes with ``kill()``."""

    def __init__(self, tmp: Path, *args: str):
        self.out = tmp / "runs" / "bp"
        self.log_path = tmp / "torchrun.log"
        self.proc = subprocess.Popen([*TORCHRUN, str(SCRIPT), str(self.out), *args], env=_env(), cwd=tmp,
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def at_breakpoint(self, timeout: float = 120, when=lambda doc: True) -> dict:
        end = time.monotonic() + timeout
        path = self.out / "attach.json"
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log()
            if path.exists():
                doc = json.loads(path.read_text())
                if when(doc):
                    return doc
            time.sleep(0.1)
        raise AssertionError(f"no attach.json after {timeout}s\n{self.log()}")

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in procs:  # a controller that left the session would still be a child here
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)

    def result(self) -> dict:
        return json.loads((self.out / "result.json").read_text())


@pytest.fixture
def job_factory(tmp_path):
    jobs: list[Job] = []

    def make(*args: str) -> Job:
        jobs.append(Job(tmp_path, *args))
        return jobs[-1]

    yield make
    for j in jobs:
        j.kill()


def _double_scale() -> float:
    from workbench.job.attach import here

    model = here()["model"]
    model.scale.mul_(2.0)
    return float(model.scale)


def test_attach_probe_change_a_buffer_resume(job_factory):
    job = job_factory("--deadline", "120", "--again")
    doc = job.at_breakpoint()
    assert doc["status"] == "waiting" and doc["world_size"] == 2 and doc["point"] == "built"
    assert "model" in doc["names"]
    t0 = time.perf_counter()
    cluster = wb.connect(job=job.out)
    attach_s = time.perf_counter() - t0
    try:
        assert cluster.world_size == 2 and cluster.backend == "gloo"
        assert cluster.pids[0] != cluster.pids[1] and all(psutil.pid_exists(p) for p in cluster.pids.values())
        rows = cluster.probe("model")
        assert set(rows["rank"]) == {0, 1}
        assert {"model.lin.weight", "model.scale"} <= set(rows["name"])
        # the job's own process group, as it is: a collective from the client's function
        got = cluster.run(_all_reduce_rank)
        assert got == {0: 1.0, 1: 1.0}
        assert cluster.run(_double_scale) == {0: 2.0, 1: 2.0}
        # a cell's print comes back to the client (and the job's own fds stay the job's: see the log below)
        ar = cluster._client[cluster._ids].execute("print('scale', float(model.scale), rank)", block=True)
        assert [s.strip() for s in ar.stdout] == ["scale 2.0 0", "scale 2.0 1"]
        stacks = cluster.stacks()  # through each rank's control thread: the main thread sits in the breakpoint
        assert set(stacks) == {0, 1} and all("breakpoint_job.py" in s and "in breakpoint" in s for s in stacks.values())
        with pytest.raises(ClusterError, match="runs its own script"):
            cluster.session(None)
        done = cluster.resume()
    finally:
        if cluster.alive:
            cluster.stop()
    assert done["status"] == "resumed" and done["by"] == "client"
    # the second breakpoint of the same processes: a fresh controller, the change still there
    job.at_breakpoint(when=lambda d: d["breakpoint"] == 1 and d["status"] == "waiting")
    again = wb.connect(job=job.out)
    try:
        assert again.run(_scale_and_first) == {0: [2.0, "client"], 1: [2.0, "client"]}
        assert again.resume()["by"] == "client"
    finally:
        if again.alive:
            again.stop()
    assert job.wait(120) == 0, job.log()
    res = job.result()
    assert res["by"] == "client" and res["again"] == "client" and res["scale"] == [2.0, 2.0]
    # no engine thread (heartbeat, control, iopub) outlives its breakpoint; the rank's own control thread (once
    # per process, started when a client first attached) stays
    assert res["threads_left"] == ["workbench-control"]
    assert res["out"] == pytest.approx(2 * 2.0 * 2 * 4 * (4 * 0.5 + 0.5))  # 2 ranks, the buffer doubled
    assert "rank 1: back from the breakpoint (client), scale 2.0" in job.log()
    print(f"controller up {doc['ready_s']:.2f}s into the breakpoint, engines registered {res['attach_s']:.2f}s "
          f"into it, wb.connect {attach_s:.2f}s, resume {done['resume_s']:.2f}s")
    # the capture directory still opens as the job's shards (attach.json and the controller's files beside them)
    b = wb.load(job.out)
    assert b.problems == [] and b.bug.steps[0] == "built"  # then "after built": the calls since, the notebook's too
    frames = list(b.bug.ledger["user_frame"])
    assert any("test_job_attach.py" in f for f in frames)  # the notebook's all_reduce, on the job's own group
    assert not any("workbench/job" in f for f in frames)  # the breakpoint itself issues no collective
    with pytest.raises(ClusterError, match="not at a breakpoint now"):
        wb.connect(job=job.out)


def _scale_and_first() -> list:
    from workbench.job.attach import here

    return [float(here()["model"].scale), here()["first"]]


def _all_reduce_rank() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor(float(dist.get_rank()))
    dist.all_reduce(t)
    return float(t)


def test_no_client_the_job_resumes_at_its_deadline(job_factory):
    job = job_factory("--deadline", "3")
    job.at_breakpoint()
    assert job.wait(120) == 0, job.log()
    res = job.result()
    assert res["by"] == "deadline" and res["scale"] == [1.0, 1.0] and res["seconds"] >= 3
    assert "rank 0: back from the breakpoint (deadline), scale 1.0" in job.log()
    doc = json.loads((job.out / "attach.json").read_text())
    assert doc["status"] == "resumed" and doc["by"] == "deadline"
    assert not psutil.pid_exists(doc["controller_pid"]) or \
        psutil.Process(doc["controller_pid"]).status() == psutil.STATUS_ZOMBIE


def test_a_notebook_that_detaches_leaves_the_job_to_its_deadline(job_factory):
    job = job_factory("--deadline", "15")
    job.at_breakpoint()
    cluster = wb.connect(job=job.out)
    assert cluster.run(_double_scale) == {0: 2.0, 1: 2.0}
    cluster.stop()  # the notebook goes away without resuming
    assert job.wait(120) == 0, job.log()
    res = job.result()
    assert res["by"] == "deadline" and res["scale"] == [2.0, 2.0]


def test_a_killed_job_leaves_no_controller(job_factory):
    job = job_factory("--deadline", "120")
    doc = job.at_breakpoint()
    controller = psutil.Process(doc["controller_pid"])
    os.kill(doc["pid"], signal.SIGKILL)  # rank 0, the controller's parent, dies at the breakpoint
    controller.wait(timeout=30)  # it goes with its parent (PR_SET_PDEATHSIG), not with the test's cleanup
    with pytest.raises(ClusterError, match="is gone"):
        wb.connect(job=job.out)
    assert job.wait(120) != 0


def test_a_controller_the_user_named(job_factory, tmp_path):
    """``controller=<ipcontroller-engine.json>``: the ranks register there; resuming leaves it running."""
    pdir = tmp_path / "ctl"
    ctl = subprocess.Popen([sys.executable, "-m", "ipyparallel.controller", f"--profile-dir={pdir}", "--ip=127.0.0.1",
                            "--cluster-id=mine", "--log-level=WARN"], env=_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        engine_file = pdir / "security" / "ipcontroller-mine-engine.json"
        end = time.monotonic() + 60
        while not (engine_file.exists() and (pdir / "security" / "ipcontroller-mine-client.json").exists()):
            assert ctl.poll() is None and time.monotonic() < end
            time.sleep(0.1)
        time.sleep(0.2)
        job = job_factory("--deadline", "120", "--controller", str(engine_file))
        doc = job.at_breakpoint()
        assert doc["controller_pid"] is None and doc["client_file"].endswith("ipcontroller-mine-client.json")
        cluster = wb.connect(job=job.out)
        try:
            assert cluster.run(_double_scale) == {0: 2.0, 1: 2.0}
            cluster.resume()
        finally:
            if cluster.alive:
                cluster.stop()
        assert job.wait(120) == 0, job.log()
        assert job.result()["scale"] == [2.0, 2.0]
        assert ctl.poll() is None  # the user's controller is the user's to stop
    finally:
        os.killpg(ctl.pid, signal.SIGKILL)
        ctl.wait(timeout=30)
