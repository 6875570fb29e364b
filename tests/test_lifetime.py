"""Processes the workbench starts die with the client that started them, and with ``stop()``.

Real clients: ``workbench run`` and a Jupyter kernel killed with SIGKILL mid-step (no cleanup
of theirs runs), and a cluster whose controller hub was killed before ``stop()``. Each step
writes its process's marker (``WORKBENCH_TREE``) to a file, so the test knows the tree to
look for without asking the client.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import workbench as wb
from workbench.live import lease

GONE_WITHIN_S = 10.0  # generous: the reaper wakes on the parent-death signal or within POLL_S (0.2 s); without it
# the tree outlives its client for ever, which is the defect these tests guard


def _slow_scenario(tmp_path) -> str:
    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent(f'''
        import os
        import time
        import workbench as wb

        SCENARIO = wb.Scenario("slow")

        @SCENARIO.step
        def wait(ctx):
            with open({str(tmp_path)!r} + f"/in-step{{ctx.rank}}", "w") as f:
                f.write(os.environ.get("WORKBENCH_TREE", ""))
            time.sleep(120)
    '''))
    return str(path)


def _token(tmp_path, proc_alive, what: str) -> str:
    end = time.monotonic() + 120
    marker = tmp_path / "in-step1"
    while not (marker.exists() and marker.read_text()) and proc_alive() and time.monotonic() < end:
        time.sleep(0.2)
    assert marker.exists() and marker.read_text(), f"{what} never reached its step"
    return marker.read_text()


def _gone_after_kill(pid: int, token: str) -> float:
    """SIGKILL ``pid``; seconds until no process carries ``token`` (fails past the bound)."""
    assert len(lease.members(token)) >= 3  # controller and two engines at least
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while lease.members(token) and time.monotonic() - t0 < GONE_WITHIN_S:
        time.sleep(0.1)
    left = [p for p in lease.members(token) if lease.running(p)]  # one that died as the bound passed is gone
    described = [_describe(p) for p in left] + _reaper(token) if left else []
    lease.kill(left)  # a failing run must not leak what it tests for
    assert left == [], described
    return time.monotonic() - t0


def _reaper(token: str) -> list[str]:
    """The tree's reaper as a failure names it (it carries the token in its arguments, not its marker)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if token in (p.info["cmdline"] or []):
            found.append("reaper " + _describe(p))
    return found or ["no reaper process"]


def _describe(p: psutil.Process) -> str:
    """The process as a failure message names it: a zombie or a vanished one has no command line left."""
    try:
        return f"pid {p.pid} ppid {p.ppid()} {p.status()}: {' '.join(p.cmdline())}"
    except psutil.Error as exc:
        return f"pid {p.pid}: {type(exc).__name__}"


def test_sigkill_of_workbench_run_mid_step_leaves_no_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", f"{_slow_scenario(tmp_path)}:",
                             "--timeout", "8", "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        token = _token(tmp_path, lambda: proc.poll() is None, "workbench run")
        seconds = _gone_after_kill(proc.pid, token)
        print(f"workbench run: no process {seconds:.2f}s after SIGKILL")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_sigkill_of_a_notebook_kernel_mid_step_leaves_no_process(tmp_path):
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        spec = _slow_scenario(tmp_path) + ":"
        kc.execute(f"import workbench as wb\nc = wb.start(ranks=2, backend='gloo', timeout=8, progress=False)\n"
                   f"s = c.session({spec!r})\ns.step()\n")
        pid = km.provisioner.process.pid
        token = _token(tmp_path, km.is_alive, "the kernel")
        seconds = _gone_after_kill(pid, token)
        print(f"kernel: no process {seconds:.2f}s after SIGKILL")
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        km.cleanup_resources()


def test_stop_after_the_hub_died_ends_every_scheduler():
    c = wb.start(ranks=2, backend="gloo", timeout=8)
    token = c._lease.token
    try:
        procs = lease.members(token)
        hub = psutil.Process(c._ipp.controller.process.pid)
        schedulers = [p for p in procs if p.ppid() == hub.pid]
        assert len(schedulers) >= 2, [" ".join(p.cmdline()) for p in procs]
        hub.kill()
        psutil.wait_procs([hub], timeout=5)
        assert any(p.is_running() for p in schedulers)  # orphans: what ending only the children leaves
    finally:
        c.stop()
    assert lease.members(token) == []


def test_stop_ends_a_daemon_a_step_double_forked():
    def spawn_daemon() -> int:
        import os
        import time

        r, w = os.pipe()
        if os.fork() == 0:  # child: fork again and leave, so the grandchild is nobody's child
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                time.sleep(300)
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 32))
        os.wait()
        return pid

    c = wb.start(ranks=2, backend="gloo", timeout=8)
    try:
        daemon = psutil.Process(c.run(spawn_daemon, ranks=[0])[0])
        assert daemon.ppid() != c.pids[0]  # reparented: no longer in the engine's tree
    finally:
        c.stop()
    psutil.wait_procs([daemon], timeout=5)
    assert not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_a_frozen_client_loses_its_ranks_when_its_lease_lapses(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", f"{_slow_scenario(tmp_path)}:",
                             "--timeout", "8", "--no-progress"], env={**os.environ, "WORKBENCH_LEASE_S": "3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        token = _token(tmp_path, lambda: proc.poll() is None, "workbench run")
        os.kill(proc.pid, signal.SIGSTOP)  # alive but frozen: only the lease can tell
        end = time.monotonic() + 3 + GONE_WITHIN_S
        while lease.members(token) and time.monotonic() < end:
            time.sleep(0.2)
        left = lease.members(token)
        lease.kill(left)
        assert left == []
    finally:
        proc.kill()
        proc.wait(10)


# An engine that cannot bind a port another process holds: the real ZMQError, in a real ipengine process, which then
# exits (an exception in sitecustomize is otherwise only printed). Which start-up's engines fail is keyed by the
# cluster id ipyparallel gives each start: "first" fails every engine of the first start only, "every" all of them.
_BIND_FAILS = '''
import fcntl, os
if b"ipyparallel.engine" in open("/proc/self/cmdline", "rb").read():
    cid = os.environ.get("IPP_CLUSTER_ID", "")
    with open(os.environ["WB_TEST_FAIL_FILE"], "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        first = f.read().strip()
        if not first:
            f.write(cid)
            first = cid
    if os.environ["WB_TEST_FAIL_WHICH"] == "every" or cid == first:
        import traceback, zmq
        try:
            zmq.Context.instance().socket(zmq.PULL).bind("tcp://127.0.0.1:" + os.environ["WB_TEST_BUSY_PORT"])
        except zmq.ZMQError:
            traceback.print_exc()
            os._exit(1)
'''


def _engines_that_cannot_bind(tmp_path, which: str):
    """A port held here, and the environment whose engines try to bind it (``which``: "first" or "every" start)."""
    import socket

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_BIND_FAILS)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])),
           "WB_TEST_FAIL_FILE": str(tmp_path / "first-cluster"), "WB_TEST_FAIL_WHICH": which,
           "WB_TEST_BUSY_PORT": str(busy.getsockname()[1])}
    return busy, env


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _no_child_left(before: set[int]):
    """The processes this test started that are still running (the lane's own, a session cluster's among them, were
    there ``before``)."""
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != "zombie"]
    return [_describe(p) for p in left]


def test_a_start_whose_engines_stopped_early_is_tried_again_on_fresh_ports(tmp_path):
    """Two lanes (or notebooks) starting engines at once: ipyparallel picks ports, then binds them, and the other
    one may take a port in between; the engine set stops. The start is tried once more, and a real cluster runs."""
    from workbench.live.engines import Engines

    busy, env = _engines_that_cannot_bind(tmp_path, "first")
    before = _children()
    with busy:
        e = Engines(ranks=1, backend="gloo", timeout=8, env=env)
        try:
            with pytest.warns(UserWarning, match="tried again on fresh ports: an engine could not bind"):
                e.start()
            assert e.call(os.getpid).values == {0: e.pids[0]}  # the second start's engine answers
            port = busy.getsockname()[1]
            assert len(e.start_retries) == 1 and f"127.0.0.1:{port}: port in use" in e.start_retries[0], \
                e.start_retries
        finally:
            e.stop()
    assert _no_child_left(before) == []


def test_a_start_that_stops_early_twice_names_the_port_in_use(tmp_path):
    from workbench.errors import ClusterError
    from workbench.live.engines import Engines

    busy, env = _engines_that_cannot_bind(tmp_path, "every")
    port = busy.getsockname()[1]
    before = _children()
    with busy:
        with pytest.raises(ClusterError) as failed:
            Engines(ranks=1, backend="gloo", timeout=8, env=env).start()
    line = str(failed.value)
    assert "\n" not in line and f"127.0.0.1:{port}: port in use" in line and "tried twice" in line, line
    assert _no_child_left(before) == []
