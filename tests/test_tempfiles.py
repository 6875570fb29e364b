"""A run leaves nothing in the temp dir or /dev/shm that it did not say it keeps.

Engines are killed, never asked to exit, and so are the ``torch_shm_manager`` processes torch starts beside
them for ``file_system`` sharing (the weight-sync scenarios' CPU IPC handles): each killed engine left
``$TMPDIR/torch-shm-dir-*``, its segments in ``/dev/shm`` and its ``wb-stacks-*.txt``. Each test runs a real
client in a subprocess with a temp dir of its own, so the test sees exactly what the run left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from workbench.live import lease

SHM = "/dev/shm"

CLIENT = textwrap.dedent('''
    import os
    import sys
    import time

    import workbench as wb


    def share():
        """What the weight-sync IPC does on CPU: a tensor pickled to a shared-memory name."""
        import io
        import pickle
        from multiprocessing.reduction import ForkingPickler

        import torch
        import torch.multiprocessing as tmp
        from torch.multiprocessing.reductions import reduce_tensor

        tmp.set_sharing_strategy("file_system")
        t = torch.ones(4096)
        ForkingPickler(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(reduce_tensor(t))
        globals()["_kept"] = t  # alive on the rank, as a handle's tensor is until the receiver is done
        return os.getpid()


    TINY = wb.Scenario("tiny-temp", probe=None)


    @TINY.step
    def one(ctx):
        pass


    c = wb.start(ranks=2, backend="gloo", timeout=8, progress=False)
    pids = c.run(share)
    s = c.session(TINY)  # never closed: its ledger dir is the client's to remove at exit
    assert s.step().ok
    assert os.path.isdir(s.ledger_dir)
    print(c._lease.token, *pids.values(), flush=True)
    if sys.argv[1] == "stop":
        c.stop()
    else:
        time.sleep(600)  # killed by the test
''')


def _segments(pids) -> list[str]:
    return sorted(n for n in os.listdir(SHM) for p in pids if n.startswith(f"torch_{p}_"))


@pytest.fixture()
def short_tmp():
    """The client's temp dir, on a short path: torch_shm_manager binds ``$TMPDIR/torch-shm-dir-*/manager.sock``
    and a Unix socket's path holds 107 bytes at most (a lane's ``tmp_path`` under pytest-xdist passed that)."""
    d = tempfile.mkdtemp(prefix="wbt-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _start(tmp_path, how: str, tmp: Path) -> tuple[subprocess.Popen, str, list[int], str]:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(tmp)})
    line = proc.stdout.readline().split()
    if not line:
        proc.kill()
        pytest.fail(proc.stderr.read()[-3000:])
    return proc, line[0], [int(p) for p in line[1:]], str(tmp)


def _during(tmp: str, pids: list[int]) -> None:
    """What the run holds while it runs: the test checks what it looks for."""
    names = os.listdir(tmp)
    assert any(n.startswith("torch-shm-dir-") for n in names), names
    assert any(n.startswith("wb-stacks-") for n in names), names
    assert any(n.startswith("wb-ledger-") for n in names), names
    assert _segments(pids), os.listdir(SHM)


def test_a_stopped_cluster_leaves_nothing_in_the_temp_dir_or_dev_shm(tmp_path, short_tmp):
    proc, token, pids, tmp = _start(tmp_path, "stop", short_tmp)
    try:
        assert proc.wait(120) == 0, proc.stderr.read()[-3000:]
        assert sorted(os.listdir(tmp)) == [] and _segments(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        lease.end_tree(token, within=0)


def test_a_killed_clients_leftovers_go_with_its_ranks(tmp_path, short_tmp):
    proc, token, pids, tmp = _start(tmp_path, "sleep", short_tmp)
    try:
        _during(tmp, pids)
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup of the client runs: its reaper ends the tree
        proc.wait(30)
        end = time.monotonic() + 15
        while (os.listdir(tmp) or _segments(pids)) and time.monotonic() < end:
            time.sleep(0.2)
        assert sorted(os.listdir(tmp)) == [] and _segments(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        lease.end_tree(token, within=0)


SLOW = '''
import time
import workbench as wb

SCENARIO = wb.Scenario("slow-temp", probe=None)


@SCENARIO.step
def wait(ctx):
    open(MARKER, "w").close()
    time.sleep(120)
'''


def test_down_clears_what_a_killed_attached_run_left(tmp_path):
    """`workbench run --cluster P` killed mid-step (no cleanup of its own runs, and no reaper: the ranks are the
    cluster's) left its session's ledger dir, and the ranks their work dirs: `down` clears them."""
    tmp, marker = tmp_path / "tmp", tmp_path / "in-step"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "IPYTHONDIR": str(tmp_path / "ipy")}
    sc = tmp_path / "slow.py"
    sc.write_text(SLOW.replace("MARKER", repr(str(marker))))
    cli = [sys.executable, "-m", "workbench.cli"]
    up = subprocess.run([*cli, "up", "--ranks", "1", "--profile", "tmpclean"], env=env, capture_output=True,
                        text=True, timeout=240)
    assert up.returncode == 0, up.stderr[-2000:]
    run = None
    try:
        run = subprocess.Popen([*cli, "run", f"{sc}:", "--cluster", "tmpclean", "--no-progress"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 120
        while not marker.exists() and run.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert marker.exists(), "the run never reached its step"
        run.kill()
        run.wait(30)
        assert any(n.startswith("wb-ledger-") for n in os.listdir(tmp)), os.listdir(tmp)
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        down = subprocess.run([*cli, "down", "--profile", "tmpclean"], env=env, capture_output=True, text=True,
                              timeout=120)
    assert down.returncode == 0, down.stderr[-2000:]
    # torch's own per-user cache (`import transformers...modeling_auto`, warmed by `up`, makes it): one dir,
    # the same for every run, not a leftover
    assert sorted(n for n in os.listdir(tmp) if not n.startswith("torchinductor_")) == []
