"""A cluster's engines are forked from one process that imported torch and the rank layer once (issue 49).

Real engines: the session's shared cluster, and one cluster of this file's own whose set process is killed
outright (its engines go with it, and the cluster restarts), then restarted the plain way
(``WORKBENCH_ENGINE_FORK=0``: one ``python -m ipyparallel.engine`` each).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

import workbench as wb
from workbench.live import engine_fork
from workbench.live import lease as live_lease


def _parent() -> tuple[int, int, str, bool]:
    """(this engine's pid, its parent's pid, the parent's command line, whether the parent has torch mapped)."""
    ppid = os.getppid()
    with open(f"/proc/{ppid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode()
    with open(f"/proc/{ppid}/maps") as f:
        torch_mapped = "libtorch" in f.read()
    return os.getpid(), ppid, cmd, torch_mapped


def test_the_engines_are_forked_from_one_set_process_that_imported_torch(healthy):
    seen = healthy.run(_parent)
    parents = {ppid for _, ppid, _, _ in seen.values()}
    assert len(parents) == 1, seen  # one set process for the whole cluster
    for rank, (pid, _, cmd, torch_mapped) in seen.items():
        assert pid == healthy.pids[rank]
        assert f"-m {engine_fork.__name__} {healthy.world_size} " in cmd and " -- " in cmd, cmd
        assert "-m ipyparallel.engine" in cmd, cmd  # the engine command ipyparallel gave, run in the child
        assert torch_mapped, "the set process imported torch before it forked"


def _marker_of(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    value = env.get(live_lease.MARK.encode())
    return value.decode() if value else None


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_killed_set_takes_its_engines_and_the_plain_launch_is_one_switch_away(monkeypatch):
    c = wb.start(ranks=2, backend="gloo", timeout=20)
    engines = list(c.pids.values())
    try:
        parents = {psutil.Process(p).ppid() for p in engines}
        assert len(parents) == 1
        (set_pid,) = parents
        # the lease's marker reaches the forked engines (``down`` and the reaper find them by it)
        marks = {_marker_of(p) for p in [set_pid, *engines]}
        assert len(marks) == 1 and None not in marks, marks
        os.kill(set_pid, signal.SIGKILL)  # no chance to forward anything: the engines die with it all the same
        assert _gone(engines, 10), [p for p in engines if psutil.pid_exists(p)]
        monkeypatch.setenv(engine_fork.ENV, "0")
        c.restart()
        plain = list(c.pids.values())
        assert {r: v[:2] for r, v in c.run(lambda: (__import__("torch").distributed.get_rank(), 2)).items()} == \
            {0: (0, 2), 1: (1, 2)}
        for p in plain:  # each engine started on its own by ipyparallel's launcher, in this process
            assert psutil.Process(p).ppid() == os.getpid()
        engines += plain
    finally:
        c.stop()
    assert _gone(engines, 5)


def _draw_in_a_fork() -> int:
    import numpy as np

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # as the set's child does before it becomes an engine
        os.close(r)
        engine_fork.fresh_process_state()
        os.write(w, str(np.random.randint(0, 1 << 62)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        value = int(f.read())
    os.waitpid(pid, 0)
    return value


def test_a_forked_engine_draws_its_own_unseeded_numpy_stream():
    """numpy does not reseed its global generator on a fork: unseeded user code on two engines forked from a set
    that had imported numpy.random would agree across ranks, where the user's own processes would not."""
    import numpy as np

    np.random.seed(1234)  # the parent's state, which every fork would inherit
    assert _draw_in_a_fork() != _draw_in_a_fork()
