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
POSTMORTEM = ROOT / "examples" / "postmortem_job.py"


def _line_of(text: str, path: Path = POSTMORTEM) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_CAPTURE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


class Job:
    """torchrun in a session of its own: everything it started goes with ``kill()``."""

    def __init__(self, tmp: Path, *args: str, script: Path = SCRIPT):
        self.out = tmp / "runs" / "bp"
        self.log_path = tmp / "torchrun.log"
        self.tmpdir = tmp / "tmpdir"  # the job's own TMPDIR: what the workbench leaves there is seen
        self.tmpdir.mkdir(exist_ok=True)
        self.proc = subprocess.Popen([*TORCHRUN, str(script), str(self.out), *args],
                                     env={**_env(), "TMPDIR": str(self.tmpdir)}, cwd=tmp,
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

    def left_in_tmpdir(self) -> list[str]:
        """What the workbench left in the job's TMPDIR (torch's own ``torchelastic_*``, ``torchinductor_*`` aside)."""
        torch_own = ("torchelastic_", "torchinductor_")
        return sorted(p.name for p in self.tmpdir.iterdir() if not p.name.startswith(torch_own))

    def result(self) -> dict:
        return json.loads((self.out / "result.json").read_text())


@pytest.fixture
def job_factory(tmp_path):
    jobs: list[Job] = []

    def make(*args: str, script: Path = SCRIPT) -> Job:
        jobs.append(Job(tmp_path, *args, script=script))
        return jobs[-1]

    yield make
    for j in jobs:
        j.kill()


def _double_scale() -> float:
    from workbench.job.engine import here

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
        assert cluster._ids == [0, 1]  # each engine's id is its rank: %%px labels its output [stdout:<rank>]
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
    with pytest.raises(ClusterError, match="not attachable now"):
        wb.connect(job=job.out)


def _scale_and_first() -> list:
    from workbench.job.engine import here

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
    assert res["by"] == "deadline" and res["scale"] == [1.0, 1.0]
    assert isinstance(res["seconds"], float) and res["seconds"] > 0  # measured; how long is the box's, not asserted
    assert "rank 0: back from the breakpoint (deadline), scale 1.0" in job.log()
    doc = json.loads((job.out / "attach.json").read_text())
    assert doc["status"] == "resumed" and doc["by"] == "deadline"
    # the order of events, not a duration: the deadline came first, then the ranks resumed (not before it)
    assert doc["started_at"] < doc["deadline_at"] <= doc["resumed_at"]
    assert not psutil.pid_exists(doc["controller_pid"]) or \
        psutil.Process(doc["controller_pid"]).status() == psutil.STATUS_ZOMBIE
    assert job.left_in_tmpdir() == []


def test_sigterm_to_torchrun_at_a_breakpoint_leaves_no_process_and_no_temp_file(job_factory):
    job = job_factory("--deadline", "120")
    doc = job.at_breakpoint()
    cluster = wb.connect(job=job.out)  # a notebook attached when the scheduler ends the job
    assert cluster.run(_double_scale) == {0: 2.0, 1: 2.0}
    procs = psutil.Process(job.proc.pid).children(recursive=True)
    assert any(p.pid == doc["controller_pid"] for p in procs)
    job.proc.send_signal(signal.SIGTERM)  # torchrun's own: it ends its ranks, as a scheduler's preemption would
    assert job.wait(120) != 0
    _, alive = psutil.wait_procs(procs, timeout=30)
    cluster.stop()
    assert alive == [], alive
    assert job.left_in_tmpdir() == []


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
    schedulers = controller.children(recursive=True)  # forked by ipcontroller: they must not outlive it
    assert schedulers
    os.kill(doc["pid"], signal.SIGKILL)  # rank 0, the controller's parent, dies at the breakpoint
    controller.wait(timeout=30)  # it goes with its parent (PR_SET_PDEATHSIG), not with the test's cleanup
    _, left = psutil.wait_procs(schedulers, timeout=30)
    for p in left:  # a failing run must not leak what it tests for
        p.kill()
    assert left == [], [p.pid for p in left]
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


def _hang_cell_started(cluster, code: str):
    """A cell that never returns on its own, sent without waiting for it (as a notebook's %%px would hang)."""
    ar = cluster._client[cluster._ids].execute(code, block=False)
    time.sleep(0.5)
    assert not ar.ready()
    return ar


def test_a_hung_cell_does_not_hold_the_breakpoint_past_its_deadline(job_factory):
    """The deadline wins over a %%px cell that never returns: it is interrupted (the cell fails with
    KeyboardInterrupt, the notebook sees it) and the ranks go on. Before, the engine's loop ran the deadline's
    timer on the thread the cell held: the job stayed at the breakpoint as long as the cell ran."""
    job = job_factory("--deadline", "8")
    doc = job.at_breakpoint()
    cluster = wb.connect(job=job.out)
    try:
        ar = _hang_cell_started(cluster, "import time\ntime.sleep(600)")  # rank 0 and 1, on their main threads
        assert job.wait(60) == 0, job.log()
        with pytest.raises(Exception, match="KeyboardInterrupt"):
            ar.get(timeout=30)
    finally:
        cluster.stop()
    res = job.result()
    assert res["by"] == "deadline" and res["scale"] == [1.0, 1.0]
    done = json.loads((job.out / "attach.json").read_text())
    assert done["status"] == "resumed" and done["by"] == "deadline"
    # the deadline, not the cell (it sleeps 600 s), ended the wait: at the deadline the cell still ran (the
    # watchdog recorded it), was interrupted (the KeyboardInterrupt above), and the ranks resumed after the deadline
    assert done["hung"]["interrupted"] is True and isinstance(done["hung"]["cell_s"], float)
    assert doc["deadline_at"] <= done["resumed_at"]


def _postmortem_view() -> list:
    import threading

    from workbench.job.engine import here

    ns = here()
    exc = ns.get("exc")
    return [type(exc).__name__ if exc is not None else None, list(ns["batch"].shape), ns["frame"].f_code.co_name,
            threading.current_thread() is threading.main_thread()]


def _probe_gives_up() -> None:
    from workbench.rank import phases

    def gives_up(objects):
        raise TimeoutError("cuda:0 did not answer a copy in 5 s")

    phases.probe_rows = gives_up


def _gone(pids) -> bool:
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


def test_post_mortem_after_one_rank_raises(job_factory):
    """Rank 1 raises in its step while rank 0 waits in the step's all-reduce: both ranks attach (rank 1 on its
    main thread at the exception, rank 0 from its watcher thread), the account names the raise and the wait,
    and after resume the job fails with rank 1's own exception, leaving no process."""
    job = job_factory("--deadline", "120", script=POSTMORTEM)
    t0 = time.perf_counter()
    doc = job.at_breakpoint()
    attachable_s = time.perf_counter() - t0
    assert doc["kind"] == "post-mortem" and doc["status"] == "waiting"
    t1 = time.perf_counter()
    cluster = wb.connect(job=job.out)
    connect_s = time.perf_counter() - t1
    try:
        pm = cluster.post_mortem
        ready_s = doc["started_at"] + doc["ready_s"] - pm["t"]  # from the raise to attach.json
        assert pm["reason"] == "error" and pm["rank"] == 1
        assert pm["error"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
        assert pm["where"].endswith(f"postmortem_job.py:{_line_of('loss = model(batch)')} in step")
        waits = pm["ranks"]["0"]
        assert waits["role"] == "waiting"
        assert waits["where"].endswith(f"postmortem_job.py:{_line_of('dist.all_reduce(loss')} in step")
        assert [(c["op"], c["group"]) for c in waits["open_calls"]] == [("all_reduce", "0")]
        # the account leads with the rank that raised, its message whole
        assert pm["line"].startswith("rank 1 raised RuntimeError: mat1 and mat2 shapes cannot be multiplied "
                                     "(4x6 and 8x8) at "), pm["line"]
        assert "; rank 0 waits in all_reduce #3" in pm["line"]
        rows = cluster.probe("model")
        assert set(rows["rank"]) == {0, 1} and "model.0.weight" in set(rows["name"])
        assert rows.attrs["problems"] == [] and "as_of" not in rows.columns
        # each rank's own names (rank 1: the failing frame's locals and the exception), no module dunders
        assert {"exc", "batch", "model", "cap"} <= set(cluster.names[1]) and "exc" not in cluster.names[0]
        assert not any(n.startswith("__") for names in cluster.names.values() for n in names)
        assert "names " in repr(cluster) and "rank 1 also " in repr(cluster) and "__name__" not in repr(cluster)
        # a rank whose device cannot be read (a GPU held behind a stuck collective, made here by a probe that
        # gives up as the host copy does) answers with its last point's rows, labelled; the probe still returns
        cluster.run(_probe_gives_up, ranks=[0])
        rows = cluster.probe("model")
        assert set(rows["rank"]) == {0, 1}
        assert set(rows[rows["rank"] == 0]["as_of"]) == {"point built"}
        assert rows[rows["rank"] == 1]["as_of"].isna().all()
        assert rows.attrs["problems"] == ["rank 0: rows as of point 'built' from its shard (its device did not "
                                          "answer now: TimeoutError: cuda:0 did not answer a copy in 5 s)"]
        # rank 1: the exception and the failing frame's locals, on its main thread; rank 0: the locals of the
        # frame that waits, from its watcher thread (its main thread is still in the all-reduce)
        assert cluster.run(_postmortem_view) == {0: [None, [4, 8], "step", False],
                                                 1: ["RuntimeError", [4, 6], "step", True]}
        main0 = cluster.stacks([0])[0].split("\n\n")[0]
        assert "all_reduce" in main0 and "postmortem_job.py" in main0
        done = cluster.resume()
    finally:
        if cluster.alive:
            cluster.stop()
    assert done["status"] == "resumed" and done["by"] == "client"
    t2 = time.perf_counter()
    assert job.wait(60) != 0
    exit_s = time.perf_counter() - t2
    log = job.log_path.read_text()
    assert "[rank1]: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x6 and 8x8)" in log
    assert _gone([*cluster.pids.values(), doc["controller_pid"]])
    # the shards' ledgers: rank 0's all-reduce #3 never ended, and the attach issued no collective of its own
    b = wb.load(job.out)
    ledger = b.bug.ledger
    assert not any("workbench/job" in str(f) for f in ledger["user_frame"])
    assert list(ledger[ledger["rank"] == 1]["seq"]) == [1, 2]
    # and the shards' diagnosis leads with the raise (a matmul's error under the ledger's mode is a cause)
    sentence = b.bug.diagnose().sentence
    assert sentence.startswith("rank 1 raised RuntimeError at examples/postmortem_job.py:"), sentence
    assert "it left rank 0 waiting" in sentence, sentence
    print(f"post mortem: attach.json {ready_s:.2f}s after the raise ({attachable_s:.2f}s after the launch), "
          f"wb.connect {connect_s:.2f}s, resume {done['resume_s']:.2f}s, job ended {exit_s:.2f}s later")


def test_post_mortem_after_a_deadlock_the_ledgers_prove(job_factory):
    """Rank 1 reduces on a subgroup while rank 0 reduces on the world: past --hang-after every rank waits and
    the calls differ, so the ledgers prove it; both ranks serve from their watcher threads, the proof names
    each call. A cell that hangs on those threads (pure Python) is interrupted at the deadline too."""
    job = job_factory("--deadline", "8", "--deadlock", "--hang-after", "1", "--timeout", "600", script=POSTMORTEM)
    doc = job.at_breakpoint()
    t0 = time.perf_counter()
    cluster = wb.connect(job=job.out)
    connect_s = time.perf_counter() - t0
    try:
        proof = cluster.post_mortem["proof"]
        late_s = cluster.post_mortem["t"] - max(c["t"] for c in proof["calls"].values()) - 1.0  # past --hang-after
        ready_s = doc["started_at"] + doc["ready_s"] - cluster.post_mortem["t"]
        assert cluster.post_mortem["reason"] == "deadlock" and proof["kind"] == "mismatched collectives"
        calls = proof["calls"]
        assert (calls["0"]["op"], calls["0"]["group"], calls["0"]["seq"]) == ("all_reduce", "0", 3)
        assert (calls["1"]["op"], calls["1"]["group"], calls["1"]["seq"]) == ("all_reduce", "1", 1)
        assert "rank 1 waits in all_reduce #1 on group 1" in proof["line"]
        assert set(cluster.probe("model")["rank"]) == {0, 1}
        ar = _hang_cell_started(cluster, "while True:\n    pass")
        with pytest.raises(Exception, match="KeyboardInterrupt"):
            ar.get(timeout=40)
    finally:
        cluster.stop()
    done = job.at_breakpoint(timeout=30, when=lambda d: d["status"] == "resumed")
    # the cell loops for ever: the deadline ended it (the watchdog found it running there and interrupted it), and
    # the ranks resumed after the deadline
    assert done["by"] == "deadline" and done["hung"]["interrupted"] is True
    assert isinstance(done["hung"]["cell_s"], float)  # how long the cell had run: recorded, not bounded here
    assert doc["deadline_at"] <= done["resumed_at"]
    # the attach is over: the job ends now (not at its group's 600 s timeout), each rank with one line
    assert job.wait(60) != 0
    log = job.log_path.read_text()
    for r in (0, 1):
        assert f"workbench: rank {r} ends now (exit status 1): the ledgers proved a deadlock (rank 0 waits in " \
               "all_reduce #3 on group 0" in log, log[-3000:]
    print(f"deadlock: proven {late_s:.2f}s past the window, attach.json {ready_s:.2f}s after, wb.connect "
          f"{connect_s:.2f}s, a hung cell interrupted {done['resumed_at'] - doc['deadline_at']:.2f}s past the deadline")


def test_attach_takes_only_what_it_names(tmp_path):
    import workbench.job as wj

    with pytest.raises(ValueError, match="attach must be 'on-error', 'on-deadlock' or 'post-mortem'"):
        wj.capture(tmp_path / "x", attach="sometimes")
    with pytest.raises(ValueError, match="needs ledger='calls' or 'full'"):
        wj.capture(tmp_path / "x", attach="on-deadlock", ledger=False)
    with pytest.raises(ValueError, match="positive seconds"):
        wj.capture(tmp_path / "x", attach="on-error", attach_deadline=0)
    assert not (tmp_path / "x").exists()


def test_post_mortem_from_an_except_that_exits_itself(job_factory):
    """``--catch``: the script catches rank 1's error, prints it, calls ``cap.post_mortem()`` and exits 1 itself
    (no ``sys.excepthook``): every rank still attaches, rank 1 at its exception, and after resume the job ends
    with the script's own exit."""
    job = job_factory("--deadline", "120", "--catch", script=POSTMORTEM)
    doc = job.at_breakpoint()
    cluster = wb.connect(job=job.out)
    try:
        pm = cluster.post_mortem
        assert doc["kind"] == "post-mortem" and pm["reason"] == "error" and pm["rank"] == 1
        assert pm["line"].startswith("rank 1 raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"), pm
        assert pm["ranks"]["0"]["role"] == "waiting"
        assert cluster.run(_postmortem_view) == {0: [None, [4, 8], "step", False],
                                                 1: ["RuntimeError", [4, 6], "step", True]}
        done = cluster.resume()
    finally:
        if cluster.alive:
            cluster.stop()
    assert done["by"] == "client"
    assert job.wait(60) != 0
    log = job.log_path.read_text()
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x6 and 8x8)" in log  # the script's print
    assert "workbench: the post-mortem attach failed" not in log


def test_post_mortem_when_every_rank_raises(job_factory):
    """``--everywhere``: every rank's batch is bad, so every rank raises and serves on its main thread at its own
    exception; the account says each raised (the one whose error came first leads), no rank waits."""
    job = job_factory("--deadline", "120", "--everywhere", script=POSTMORTEM)
    job.at_breakpoint()
    cluster = wb.connect(job=job.out)
    try:
        pm = cluster.post_mortem
        assert pm["reason"] == "error" and {i["role"] for i in pm["ranks"].values()} == {"raised"}
        first = pm["rank"]
        assert pm["line"].startswith(f"rank {first} raised RuntimeError: mat1 and mat2"), pm["line"]
        assert f"; rank {1 - first} raised RuntimeError: mat1 and mat2" in pm["line"]
        view = cluster.run(_postmortem_view)
        assert view == {0: ["RuntimeError", [4, 6], "step", True], 1: ["RuntimeError", [4, 6], "step", True]}
        assert set(cluster.probe("model")["rank"]) == {0, 1}
        done = cluster.resume()
    finally:
        if cluster.alive:
            cluster.stop()
    assert done["by"] == "client"
    assert job.wait(60) != 0
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x6 and 8x8)" in job.log_path.read_text()
    assert _gone([*cluster.pids.values()])


def test_the_account_leads_with_the_raise_and_keeps_its_message_whole():
    from workbench.job import triggers

    msg = ("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; but got "
           "torch.cuda.FloatTensor instead (while checking arguments for embedding)")
    ranks = {str(r): {"rank": r, "role": "waiting", "where": "train.py:60 in step",
                      "open_calls": [{"op": "all_gather_into_tensor", "seq": 102, "group": "0"}]} for r in (0, 1, 3)}
    ranks["2"] = {"rank": 2, "role": "raised", "where": "train.py:56 in step",
                  "error": {"type": "RuntimeError", "message": msg}}
    line = triggers._line({"reason": "error", "rank": 2}, ranks)
    assert line.startswith(f"rank 2 raised RuntimeError: {msg} at train.py:56 in step; rank 0 waits in "
                           "all_gather_into_tensor #102 on group 0 at train.py:60 in step; rank 1 waits"), line
