"""A job under the workbench never waits in silence and never takes an argument wrongly (issue 61).

A user's own script (``tests/jobs/guest_job.py``: rank 1 raises ``ValueError("bad batch on rank 1")`` at step 1,
or the two ranks reduce on different groups) under ``workbench job``:

- nobody watches (no TTY, ``CI`` set): the job fails as it would have, at once, its traceback printed once and
  nothing of ours after it; a proven deadlock is still said and ended, as soon as ``--hang-after`` allows;
- at a terminal (a pty): the traceback first, then one line (who raised, every rank attachable, for how long,
  ``wb.connect(job=DIR)``, how to end it), and Ctrl-C ends the wait as the line says;
- asked for explicitly (``--attach on-error``) where nobody watches: the same line, and a notebook's
  ``resume()`` does not print the traceback again.

And the capture's API in this process: objects by keyword only (a call it cannot take is said once and records
nothing), ``NoCapture`` with ``Capture``'s whole public surface, a second ``capture()`` and ``WORKBENCH_CAPTURE``
saying what they drop or replace.
"""

from __future__ import annotations

import inspect
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workbench as wb
import workbench.job as wj
from workbench import cli
from workbench.job import hooks, shard, triggers

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "jobs" / "guest_job.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
JOB = [sys.executable, "-m", "workbench.cli", "job"]
ENVS = ("WORKBENCH_CAPTURE", "WORKBENCH_JOB_ID", "WORKBENCH_CAPTURE_LEDGER", hooks.ENV_PID, hooks.ENV_EVERY,
        hooks.ENV_POINTS, hooks.ENV_ATTACH, hooks.ENV_POISON, hooks.ENV_DEADLINE, hooks.ENV_HANG_AFTER,
        triggers.ENV_LAUNCHER, "CI", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
TRACEBACK = "[rank1]: ValueError: bad batch on rank 1"
RAISED = "workbench: rank 1 raised ValueError: bad batch on rank 1; every rank (2) is attachable"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENVS}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]), **extra})
    return env


def _ours_after(text: str, marker: str) -> list[str]:
    """The workbench's own lines after the first line holding ``marker``."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if marker in ln)
    return [ln for ln in lines[at + 1:] if ln.startswith("workbench:")]


def _said_once_per_rank(text: str, pattern: str) -> None:
    for r in (0, 1):
        got = [ln for ln in text.splitlines() if ln.startswith(f"workbench: rank {r}: ") and re.search(pattern, ln)]
        assert len(got) == 1, (r, pattern, text[-3000:])


def _both_took(out: Path, point: str) -> bool:
    """Whether every rank's shard holds ``point``'s line."""
    try:
        return all(f'"point": "{point}"' in (out / f"rank{r}" / "points.jsonl").read_text() for r in (0, 1))
    except OSError:
        return False


def _the_api_lines(text: str, out: Path, attach: str) -> None:
    """What the script's own capture lines make each rank say, once: its path replaced, its options dropped, an
    object by position refused (nothing recorded)."""
    _said_once_per_rank(text, re.escape(f"WORKBENCH_CAPTURE={out} replaces the script's capture('runs/mine')"))
    _said_once_per_rank(text, re.escape("capture() again returns the open capture") +
                        f".*dropped: attach='on-error', hang_after=30.0 .*it keeps attach={attach!r}")
    _said_once_per_rank(text, re.escape("cap.point() cannot take this call") + ".*objects go by keyword")
    for r in (0, 1):
        points = [json.loads(ln) for ln in (out / f"rank{r}" / "points.jsonl").read_text().splitlines()]
        names = [p["point"] for p in points if p.get("kind") == "point"]
        assert names and not any(n.startswith("by-position") for n in names), names


# -- the capture's API, in this process ------------------------------------------------------------------
@pytest.fixture
def alone(monkeypatch):
    """This process as a job of one rank, nothing said yet."""
    for k in ENVS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(shard, "_SAID", set())


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_nocapture_answers_every_public_method_and_property_of_capture(alone, tmp_path):
    cap = wj.capture(tmp_path / "cap", ledger=False, poison=False)
    try:
        assert isinstance(cap, wj.Capture)
        off = wj.capture(tmp_path / "off", enabled=False)
        assert isinstance(off, wj.NoCapture)
        # the class (methods and properties) and an instance (what __init__ sets: rank, dir, points, ...)
        assert _public(wj.Capture) - _public(wj.NoCapture) == set()
        assert _public(cap) - _public(off) == set(), "NoCapture lacks what Capture has"
        for name in sorted(_public(wj.Capture)):
            mine = inspect.getattr_static(wj.Capture, name)
            if callable(mine) and not isinstance(mine, property):
                assert inspect.signature(getattr(wj.Capture, name)) == inspect.signature(getattr(wj.NoCapture, name)), \
                    name
        assert (off.rank, off.world_size, off.dir, off.points) == (0, 1, None, [])
        # keyword-only where a user would pass an object
        for cls in (wj.Capture, wj.NoCapture):
            params = inspect.signature(cls.point).parameters
            assert params["same_on"].kind is inspect.Parameter.KEYWORD_ONLY
            assert params["objects"].kind is inspect.Parameter.VAR_KEYWORD
            params = inspect.signature(cls.breakpoint).parameters
            assert {params[n].kind for n in ("deadline", "controller")} == {inspect.Parameter.KEYWORD_ONLY}
    finally:
        cap.close()


def test_a_call_the_capture_cannot_take_is_said_once_and_records_nothing(alone, tmp_path, capfd):
    import torch

    model = torch.nn.Linear(2, 2)
    cap = wj.capture(tmp_path / "cap", ledger=False, poison=False)
    try:
        for i in range(3):  # an object by position: said once, nothing recorded, no TypeError in the job
            assert cap.point(f"x{i}", model) is None
        assert cap.breakpoint(5) == {"by": "off", "seconds": 0.0}  # the deadline by position: not a breakpoint
        with cap.trace(model, "run"):  # a context manager still
            pass
        assert cap.points == []
        assert cap.point("kw", model=model)["rows"] == 2  # by keyword: recorded
        assert cap.points == ["kw"]
        err = capfd.readouterr().err
        lines = [ln for ln in err.splitlines() if "cannot take this call" in ln]
        assert len(lines) == 3, err  # point, breakpoint, trace: each once
        assert lines[0].startswith("workbench: rank 0: cap.point() cannot take this call") and \
            "objects go by keyword" in lines[0], lines[0]
    finally:
        cap.close()
    off = wj.NoCapture()
    assert off.point("x", model) is None and off.breakpoint(5)["by"] == "off"
    assert "cap.point() cannot take this call" in capfd.readouterr().err

    class Inside:  # a TypeError raised inside a method is not taken for a call it cannot take
        rank = 0

        @shard._takes()
        def f(self, x: int) -> None:
            raise TypeError("inside")

    with pytest.raises(TypeError, match="inside"):
        Inside().f(1)
    assert Inside().f(1, 2) is None
    strict = wj.capture(tmp_path / "strict", ledger=False, poison=False, strict=True)
    try:
        with pytest.raises(TypeError):  # strict: the job asked to fail fast
            strict.point("x", model)
    finally:
        strict.close()


def test_a_second_capture_and_the_environment_say_what_they_drop_once(alone, tmp_path, monkeypatch, capfd):
    env_dir = tmp_path / "env"
    monkeypatch.setenv("WORKBENCH_CAPTURE", str(env_dir))
    cap = wj.capture(tmp_path / "script", ledger=False, poison=False, name="first")
    try:
        assert cap.root == env_dir
        err = capfd.readouterr().err
        assert err.count(f"WORKBENCH_CAPTURE={env_dir} replaces the script's capture('{tmp_path / 'script'}')") == 1
        for _ in range(2):
            again = wj.capture(env_dir, ledger=False, poison=False, name="second", hang_after=5.0)
            assert again is cap
        err = capfd.readouterr().err
        assert err.count("capture() again returns the open capture") == 1, err
        assert "dropped: name='second', hang_after=5.0 (it keeps name='first', hang_after=60.0)" in err, err
        assert wj.capture(env_dir, ledger=False, poison=False, name="first") is cap  # nothing dropped: nothing said
        assert "capture() again" not in capfd.readouterr().err
    finally:
        cap.close()


def test_close_waits_for_the_watcher_in_a_store_call(alone, tmp_path, monkeypatch):
    """The post-mortem watcher asks the store from a daemon thread. One still inside that C++ call when the
    interpreter finalizes is ended by Python mid-call, and the rank aborts ('terminate called without an active
    exception': a clean job's exit status 1, seen in a fresh clone's CI). Close (at exit, before finalization)
    waits for it; here one call takes 1.5 s, as on a loaded box."""
    import threading

    from torch.distributed import HashStore

    from workbench.job import engine

    inside, store = threading.Event(), HashStore()
    real = triggers._has

    def slow(store, key):
        inside.set()
        time.sleep(1.5)
        return real(store, key)

    monkeypatch.setattr(engine, "job_store", lambda: store)
    monkeypatch.setattr(triggers, "_has", slow)
    cap = wj.capture(tmp_path / "cap", ledger=False, poison=False, attach="on-error")
    thread = cap.watch.thread
    assert inside.wait(30), "the watcher never asked the store"
    cap.close()
    assert not thread.is_alive(), "close returned with the watcher still inside a store call"


def test_who_watches_and_the_help_says_both():
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty, open(os.devnull) as null:
            assert cli.watched({}, (tty, tty))
            assert not cli.watched({"CI": "true"}, (tty, tty))
            assert cli.watched({"CI": "false"}, (tty, tty))
            assert not cli.watched({}, (null, tty)) and not cli.watched({}, (tty, null))
    finally:
        os.close(master)
        os.close(slave)
    got = subprocess.run([*JOB, "--help"], capture_output=True, text=True, env=_env(), timeout=120)
    text = " ".join(got.stdout.split())
    assert got.returncode == 0, got.stderr
    assert "Default at a terminal (stdin and stderr a TTY, CI unset): post-mortem" in text, text
    assert "Default for a run nobody watches" in text and "a raise fails the job at once" in text, text
    assert "Ctrl-C ends the wait" in text and "--hang-after S" in text, text


def test_a_job_that_sets_the_capture_itself_is_read_as_unwatched():
    """WORKBENCH_CAPTURE set by hand (no `workbench job`, so no attach word): nobody asked for a notebook."""
    from workbench.job import hooks

    assert hooks.options({})["attach"] == "on-deadlock"
    assert hooks.options({hooks.ENV_ATTACH: "post-mortem"})["attach"] == "post-mortem"
    assert hooks.options({hooks.ENV_ATTACH: "off"})["attach"] is None


# -- the user's own job under workbench job --------------------------------------------------------------
@pytest.mark.slow
def test_nobody_watches_a_raise_fails_at_once_its_traceback_once(tmp_path):
    out = tmp_path / "cap"
    # no TTY (pipes), no --attach: were it waiting for a notebook (600 s by default) this would time out
    got = subprocess.run([*JOB, str(out), "--", *TORCHRUN, str(SCRIPT), "raise"], capture_output=True, text=True,
                         env=_env(), cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=300)
    text = got.stdout + got.stderr
    assert got.returncode == 1, text[-3000:]
    assert got.stderr.count(TRACEBACK) == 1, got.stderr[-3000:]
    assert "attachable" not in text and not (out / "attach.json").exists()
    assert _ours_after(got.stderr, TRACEBACK) == []  # nothing of ours after the job's own failure
    _the_api_lines(got.stderr, out, "on-deadlock")


@pytest.mark.slow
def test_nobody_watches_a_deadlock_is_proven_after_hang_after_and_ended(tmp_path):
    out = tmp_path / "cap"
    got = subprocess.run([*JOB, str(out), "--hang-after", "2", "--attach-deadline", "5", "--", *TORCHRUN,
                          str(SCRIPT), "deadlock"], capture_output=True, text=True, env=_env(), cwd=tmp_path,
                         stdin=subprocess.DEVNULL, timeout=300)  # the group's own timeout: 300 s
    assert got.returncode == 1, got.stderr[-3000:]
    for r in (0, 1):
        doc = json.loads((out / f"rank{r}" / "shard.json").read_text())
        assert doc["attach"] == {"triggers": ["deadlock"], "deadline": 5.0, "hang_after": 2.0}
        assert f"workbench: rank {r} ends now (exit status 1): the ledgers proved a deadlock (rank 0 waits in " \
               "all_reduce #2 on group 0" in got.stderr, got.stderr[-3000:]
    said = [ln for ln in got.stderr.splitlines() if ln.startswith("workbench: the ledgers proved a deadlock")]
    assert len(said) == 1 and "rank 1 waits in all_reduce #1 on group 1" in said[0], got.stderr[-3000:]
    assert f"every rank (2) is attachable from a notebook for 5 s: wb.connect(job='{out}')" in said[0]
    pm = json.loads((out / "attach.json").read_text())
    assert pm["status"] == "resumed" and pm["by"] == "deadline" and pm["post_mortem"]["reason"] == "deadlock"


@pytest.mark.slow
def test_at_a_terminal_the_traceback_then_one_line_then_ctrl_c_ends_the_wait(tmp_path):
    out = tmp_path / "cap"
    cmd = [*JOB, str(out), "--attach-deadline", "400", "--", *TORCHRUN, str(SCRIPT), "raise"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the pty, as in a terminal
        os.chdir(tmp_path)
        os.execvpe(cmd[0], cmd, _env())
    text, sent, status = b"", False, None
    try:
        end = time.monotonic() + 300  # below the 400 s deadline: a wait Ctrl-C did not end fails here
        while status is None and time.monotonic() < end:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    text += os.read(fd, 65536)
                except OSError:  # the pty closed: every process on it is gone
                    pass
            if not sent and RAISED.encode() in text and _both_took(out, "step0"):
                # Ctrl-C, as the line says, once rank 0 is past its first point: the line may come while rank 0
                # still writes it (a loaded CI box), and Ctrl-C there ends rank 0 before its point is written
                os.write(fd, b"\x03")
                sent = True
            done, st = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(st) if done else None
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    said = text.decode(errors="replace").replace("\r\n", "\n")
    assert sent and status is not None and status != 0, said[-3000:]
    lines = said.splitlines()
    waits = [i for i, ln in enumerate(lines) if ln.startswith(RAISED)]
    assert len(waits) == 1, said[-3000:]  # once
    assert said.count(TRACEBACK) == 1, said[-3000:]  # printed before the wait, not again after it ended
    at = next(i for i, ln in enumerate(lines) if TRACEBACK in ln)
    assert at < waits[0], said[-3000:]
    assert [ln for ln in lines[at + 1:waits[0]] if ln.startswith("workbench:")] == []  # our line first after it
    line = lines[waits[0]]
    assert f"from a notebook for 400 s: wb.connect(job='{out}'); end the wait now with Ctrl-C" in line, line
    _the_api_lines(said, out, "post-mortem")


@pytest.mark.slow
def test_asked_for_where_nobody_watches_the_line_then_resume_prints_nothing_again(tmp_path):
    out = tmp_path / "cap"
    log = tmp_path / "job.log"
    proc = subprocess.Popen([*JOB, str(out), "--attach", "on-error", "--attach-deadline", "400", "--", *TORCHRUN,
                             str(SCRIPT), "raise"], env=_env(), cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    cluster = None
    try:
        end = time.monotonic() + 240
        while not ((out / "attach.json").exists() and RAISED in log.read_text()):
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.2)
        before = log.read_text()
        assert before.count(TRACEBACK) == 1 and before.index(TRACEBACK) < before.index(RAISED), before[-3000:]
        line = next(ln for ln in before.splitlines() if ln.startswith(RAISED))
        assert re.search(r"end the wait now with Ctrl-C or `kill \d+` \(or cluster.resume\(\)\)", line), line
        cluster = wb.connect(job=out)
        assert cluster.post_mortem["rank"] == 1
        assert cluster.resume()["by"] == "client"
        assert proc.wait(120) == 1
    finally:
        if cluster is not None and cluster.alive:
            cluster.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    after = log.read_text()
    assert after.count(TRACEBACK) == 1, after[-3000:]  # resume() did not print it again
    assert sum(ln.startswith(RAISED) for ln in after.splitlines()) == 1
