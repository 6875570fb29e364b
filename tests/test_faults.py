"""Faults and bad input: a clear line or a frame naming the rank, never a raw
traceback, a leaked process or a lost result. One module-scoped 2-rank cluster; the tests
that kill a rank restart it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
from conftest import ready

import workbench as wb
from workbench.errors import ClusterError

TIMEOUT_S = 8.0

TINY = wb.Scenario("tiny-faults", probe=None)


@TINY.step
def setup(ctx) -> None:
    import torch

    ctx.x = torch.ones(4)


@TINY.step
def grow(ctx) -> None:
    import torch.distributed as dist

    ctx.x = ctx.x + 1
    dist.all_reduce(ctx.x)  # one collective: the session's ledger has rows


@TINY.step
def report(ctx) -> None:
    ctx.output("x", ctx.x.clone())


def whoami() -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def wbc():
    c = wb.start(ranks=2, backend="gloo", timeout=TIMEOUT_S)
    yield c
    c.stop()


@pytest.fixture()
def fresh(wbc):
    return ready(wbc)


def _kill(cluster, rank: int) -> None:
    """Kill a rank's engine and wait until the hub has dropped it (what a user reading a table meets)."""
    p = psutil.Process(cluster.pids[rank])
    p.kill()
    psutil.wait_procs([p], timeout=10)
    end = time.monotonic() + 30
    while len(cluster._client.ids) >= cluster.world_size and time.monotonic() < end:
        time.sleep(0.2)


# 1 -------------------------------------------------------------------------------------
def test_dead_engine_between_steps_is_a_frame_and_one_clear_error(fresh):
    s = fresh.session(TINY)
    assert s.step().ok
    _kill(fresh, 1)
    frame = s.step()
    assert frame.kinds == {"died"} and set(frame.rank_errors) == {1}
    assert "cluster.restart()" in frame.rank_errors[1]
    assert "needs restart" in repr(fresh)
    for call in (fresh.run, fresh.call):
        with pytest.raises(ClusterError, match=r"rank\(s\) \[1\] died.*cluster\.restart\(\)"):
            call(whoami)
    fresh.restart()
    assert "ready" in repr(fresh) and len(fresh.run(whoami)) == 2


# 7 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, flag", [({"timeout": 0}, "timeout"), ({"timeout": -5}, "timeout"),
                                      ({"timeout": float("nan")}, "timeout"),
                                      ({"port": 70000}, "port"), ({"port": -1}, "port")])
def test_bad_timeout_and_port_fail_before_engines_start(kw, flag):
    with pytest.raises(ClusterError, match=flag) as err:
        wb.Cluster(ranks=2, backend="gloo", **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_cli_bad_timeout_is_one_line_naming_the_flag(value, capsys):
    from workbench import cli

    with pytest.raises(SystemExit) as ex:
        cli.main(["run", "fsdp1-rotary-meta-init", "--timeout", value])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--timeout" in err and "Traceback" not in err


# 8 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, spec, expect", [
    ("def broken(:\n", "", r"syntax error.*line 1"),
    ("raise RuntimeError('no config here')\n", "", r"raised at import: RuntimeError: no config here"),
    ("import workbench as wb\nSCENARIO = 3\n", ":", r"'SCENARIO' .*is of type int, not a Scenario"),
    ("import workbench as wb\nX = wb.Scenario('x')\n", ":", r"no Scenario named 'SCENARIO'; it has: X"),
    ("import workbench as wb\nthing = 'text'\n", ":thing", r"'thing' .*is of type str, not a Scenario"),
])
def test_bad_scenario_files_are_one_line(tmp_path, body, spec, expect):
    from workbench import scenarios
    from workbench.errors import WorkbenchError

    path = tmp_path / "user_sc.py"
    path.write_text(body)
    with pytest.raises(WorkbenchError, match=expect) as err:
        scenarios.resolve(f"{path}{spec or ':'}")
    assert "\n" not in str(err.value) and str(path) in str(err.value)


# 5 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--json", "--bundle", "--report"])
def test_bad_output_paths_fail_before_engines_start(tmp_path, flag, capsys):
    from workbench import cli

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    (tmp_path / "taken.out").mkdir()
    for bad in ("/dev/null/x.out", str(tmp_path / "taken.out")):
        assert cli.main(["run", "fsdp1-rotary-meta-init", flag, bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err and bad in err and "Traceback" not in err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # nothing was started


def _tiny_records(cluster):
    s = cluster.session(TINY)
    s.run()
    s.close()
    return s


def test_each_output_is_written_even_when_another_fails(fresh, tmp_path):
    from workbench import cli

    s = _tiny_records(fresh)
    (tmp_path / "taken").mkdir()
    args = cli.build_parser().parse_args(["run", "x", "--json", str(tmp_path / "taken"),
                                          "--bundle", str(tmp_path / "b.wbundle"),
                                          "--report", str(tmp_path / "r.html")])
    errors = cli.write_outputs([s], [s.record()], args)
    assert len(errors) == 1 and "--json" in errors[0]
    assert (tmp_path / "b.wbundle").is_file() and (tmp_path / "r.html").is_file()


def test_report_to_a_directory_is_one_line_and_leaves_no_temp(fresh, tmp_path, capsys):
    from workbench import cli
    from workbench.postmortem import bundle, report

    s = _tiny_records(fresh)
    b = bundle.save(s, tmp_path / "run.wbundle")
    out = tmp_path / "out"
    out.mkdir()
    assert cli.main(["report", str(b), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "-o" in err and str(out) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run.wbundle"]
    # a leftover of another writer under the old fixed temp name does not stop this one
    (tmp_path / "r.html.tmp").mkdir()
    assert report.write(bundle.load(b), tmp_path / "r.html").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r.html", "r.html.tmp", "run.wbundle"]


# 6 -------------------------------------------------------------------------------------
BOOM = wb.Scenario("boom-on-rank-1", probe=None)
BOOM.step(setup)


@BOOM.step
def boom(ctx) -> None:
    if ctx.rank == 1:
        raise ZeroDivisionError("rank 1 divides by zero")


@BOOM.step
def after(ctx) -> None:
    ctx.output("x", ctx.x.clone())


def test_after_a_failed_step_later_steps_are_skipped_on_that_rank(fresh):
    s = fresh.session(BOOM)
    frames = s.run()
    assert [f.kinds for f in frames] == [set(), {"error"}] and s.next_step == "boom"  # the cursor stays there
    s.skip()  # go on past it: rank 1 skips the later steps instead of cascading
    frames += s.run()
    assert [f.kinds for f in frames] == [set(), {"error"}, {"skipped"}]
    ev = frames[2].events
    assert list(ev["rank"]) == [1] and "'boom'" in ev.iloc[0]["message"]
    assert list(frames[2].outputs["rank"]) == [0]  # rank 0 still ran the step


def test_scenario_parameter_rules_fail_before_engines_start(capsys):
    from workbench import cli, scenarios
    from workbench.errors import WorkbenchError

    sc = scenarios.get("fsdp1-rotary-meta-init")
    for bad in ("0", "-8", "7"):
        with pytest.raises(WorkbenchError, match=f"head_dim={bad}"):
            sc.resolve_params({"head_dim": bad})
    assert sc.resolve_params({"head_dim": "16"})["head_dim"] == 16
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert cli.main(["run", "fsdp1-rotary-meta-init", "--set", "head_dim=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "head_dim=0" in err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_cli_run_whose_steps_raised_exits_non_zero(tmp_path, capsys):
    from workbench import cli

    path = tmp_path / "raises.py"
    path.write_text("import workbench as wb\nSCENARIO = wb.Scenario('raises')\n\n\n"
                    "@SCENARIO.step\ndef load(ctx):\n    raise ZeroDivisionError('head_dim 0')\n\n\n"
                    "@SCENARIO.step\ndef use(ctx):\n    ctx.model.forward()\n")
    assert cli.main(["run", f"{path}:", "--timeout", "8"]) == 1
    captured = capsys.readouterr()
    assert "ZeroDivisionError" in captured.out and "AttributeError" not in captured.out
    assert "step(s) failed" in captured.err


# 2 -------------------------------------------------------------------------------------
FLAKY = wb.Scenario("flaky-once", probe=None, params={"marker": ""})
FLAKY.step(setup)


@FLAKY.step
def grow_once(ctx) -> None:
    """Fails on rank 1 the first time only (a marker file remembers), after growing x."""
    ctx.x = ctx.x + 1
    if ctx.rank == 1 and not os.path.exists(ctx.params["marker"]):
        open(ctx.params["marker"], "w").close()
        raise RuntimeError("transient failure on rank 1")


FLAKY.step(report)


def _x(frame) -> list[float]:
    out = frame.outputs
    return [float(h[0]) for h in out[out["name"] == "x"].sort_values("rank")["head"]]


def test_recover_stands_the_cursor_at_the_failed_step_and_says_so(fresh, tmp_path):
    s = fresh.session(FLAKY, marker=str(tmp_path / "failed-once"))
    s.step()
    assert s.step().kinds == {"error"}
    info = s.recover()
    assert info["replayed"] == ["setup"] and info["cursor"] == "grow_once"
    rerun = s.step()  # the failed step again, on the replayed setup
    notes = [n for ns in rerun.notes.values() for n in ns]
    assert rerun.ok and rerun.step == "grow_once" and len(notes) == 2  # one per rank
    assert "replayed setup" in notes[0] and "cursor stood at 'grow_once'" in notes[0]
    assert _x(s.step()) == [2.0, 2.0]


# 4 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_to_workbench_run_leave_no_process(tmp_path, sig):
    import glob
    import signal
    import subprocess
    import sys
    import tempfile
    import textwrap

    marker = tmp_path / "in-step"
    name = f"slow-{os.getpid()}-{sig.lower()}"  # this test's temp dirs, and no one else's
    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent(f'''
        import time
        import workbench as wb

        SCENARIO = wb.Scenario({name!r})

        @SCENARIO.step
        def wait(ctx):
            open({str(marker)!r} + str(ctx.rank), "w").close()
            time.sleep(120)
    '''))
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", f"{path}:", "--timeout", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    family: list[psutil.Process] = []
    try:
        end = time.monotonic() + 120
        while not (tmp_path / "in-step1").exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert (tmp_path / "in-step1").exists(), proc.stderr.read() if proc.poll() is not None else "no step"
        family = psutil.Process(proc.pid).children(recursive=True)
        assert len(family) >= 3  # controller and two engines at least
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(timeout=60) == 130
        assert "interrupted; engines stopped" in proc.stderr.read()
        _, alive = psutil.wait_procs(family, timeout=5)
        assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
        tmp = tempfile.gettempdir()  # the session's ledger dir and the ranks' work dirs went with them
        assert glob.glob(os.path.join(tmp, f"wb-ledger-{name}-*")) + glob.glob(os.path.join(tmp, f"wb-{name}-*")) == []
    finally:  # a failing run must not leak what it tests for
        if proc.poll() is None:
            family += psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


# 9 -------------------------------------------------------------------------------------
def test_close_removes_the_ledger_dir_and_rank_workdirs_but_keeps_the_rows(fresh):
    import glob
    import tempfile

    s = fresh.session(TINY)
    s.run()
    workdirs = glob.glob(os.path.join(tempfile.gettempdir(), f"wb-{s.id}-r*"))
    rows = len(s.ledger)
    assert len(workdirs) == 2 and rows >= 2 and os.path.isdir(s.ledger_dir)
    first_dir = s.ledger_dir
    s.close()
    assert not os.path.exists(first_dir) and not any(os.path.exists(d) for d in workdirs)
    assert len(s.ledger) == rows and len(s.record().ledger) == rows
    s.reset()
    assert s.step().ok and s.step().ok  # a reset session gets a fresh ledger dir
    assert len(s.ledger) > rows
    s.close()
    assert not os.path.exists(s.ledger_dir)


def test_no_process_of_a_cluster_outlives_stop():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    c = wb.start(ranks=2, backend="gloo", timeout=TIMEOUT_S)
    family = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert len(family) >= 3
    c.stop()
    alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [(p.pid, p.name(), p.cmdline()[-3:]) for p in alive]


# 3 -------------------------------------------------------------------------------------
def test_no_rendezvous_listener_outside_loopback(fresh):
    import ipaddress

    listening = []
    for pid in fresh.pids.values():
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN:
                listening.append(c.laddr)
    assert any(a.port == fresh.port for a in listening)  # the store is found, and only on loopback
    outside = [a for a in listening if not ipaddress.ip_address(a.ip.split("%")[0]).is_loopback]
    assert outside == []


# -- hostile params and outputs --------------------------------------------------------
PARAMS = wb.Scenario("params-faults", probe=None, params={"theta": 1.0, "where": ""})
PARAMS.step(setup)
PARAMS.step(report)


def _json_args(path) -> object:
    from workbench import cli

    return cli.build_parser().parse_args(["run", "x", "--json", str(path)])


def test_json_of_a_nan_parameter_is_strict_and_keeps_no_machine_path(fresh, tmp_path):
    import json
    import tempfile

    from workbench import cli

    where = os.path.join(tempfile.gettempdir(), "data")  # this process's temp dir, wherever TMPDIR points
    params = PARAMS.resolve_params({"theta": "nan", "where": where})
    s = fresh.session(PARAMS, **params)
    s.run()
    s.close()
    out = tmp_path / "run.json"
    assert cli.write_outputs([s], [s.record()], _json_args(out)) == []
    text = out.read_text()
    doc = json.loads(text)  # strict JSON: no NaN token
    assert doc["params"]["theta"] == "nan" and doc["params"]["where"].startswith("<tmp>/")
    assert where not in text and str(Path.home()) + "/" not in text


DATA_DISK = "/data-disk/scratch/tmp"  # where clusters point TMPDIR: outside /tmp, home, the checkout and the venv


@pytest.mark.parametrize("cached", [True, False], ids=["tempfile-cached-another-dir", "tempfile-not-usable"])
def test_a_path_in_the_temp_dir_is_written_as_tmp_wherever_tmpdir_points(monkeypatch, cached):
    """TMPDIR pointing at a data disk is the user's temp dir even where ``tempfile.gettempdir()`` says otherwise:
    it cached another directory before TMPDIR was set (what a test lane does), or it skips TMPDIR because this
    process cannot write there (and falls back to /tmp). Either way the path is the user's machine, not the run."""
    import tempfile

    from workbench.postmortem import bundle

    monkeypatch.setenv("TMPDIR", DATA_DISK)
    monkeypatch.setattr(tempfile, "tempdir", "/var/tmp" if cached else None)
    assert tempfile.gettempdir() != DATA_DISK  # what the redaction read alone before
    assert bundle.scrub({"where": f"{DATA_DISK}/job-1/ckpt"}) == {"where": "<tmp>/job-1/ckpt"}
    assert bundle.scrub(f"{DATA_DISK}x/ckpt") == f"{DATA_DISK}x/ckpt"  # a longer name is not the temp dir


def test_json_is_written_atomically_a_full_disk_keeps_the_old_file(fresh, tmp_path):
    """A file-size limit (what a nearly full disk does to a write) fails the --json write: the old file
    stays whole under its name and no temp file is left."""
    import resource
    import signal

    from workbench import cli

    s = _tiny_records(fresh)
    out = tmp_path / "run.json"
    out.write_text('{"old": true}')
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (512, hard))
    try:
        errors = cli.write_outputs([s], [s.record()], _json_args(out))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert len(errors) == 1 and "--json" in errors[0], errors
    assert out.read_text() == '{"old": true}' and [p.name for p in tmp_path.iterdir()] == ["run.json"]


@pytest.mark.parametrize("name", ["a/b", "../up", "nul\x00", ""])
def test_a_scenario_name_that_is_no_file_name_fails_before_engines_start(tmp_path, name, capsys):
    from workbench import cli
    from workbench.errors import WorkbenchError

    with pytest.raises(WorkbenchError, match="scenario name"):
        wb.Scenario(name)
    path = tmp_path / "slash.py"
    path.write_text(f"import workbench as wb\nSCENARIO = wb.Scenario({name!r})\n")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert cli.main(["run", f"{path}:"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scenario name" in err and "Traceback" not in err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


@pytest.mark.parametrize("value", ["1" + "0" * 30, str(2**63), str(-(2**63) - 1)])
def test_an_integer_parameter_beyond_64_bits_names_its_key(value):
    from workbench import scenarios
    from workbench.errors import WorkbenchError

    with pytest.raises(WorkbenchError, match=f"hidden_size={value}.*64-bit"):
        scenarios.get("fsdp1-rotary-meta-init").resolve_params({"hidden_size": value})


def test_engines_sweep_what_killed_engines_left_in_the_temp_dir(tmp_path):
    """Every engine wrote a wb-stacks-<pid>-*.txt and per-session work dirs it never removed (engines are
    killed): the next engine to start removes those of dead pids, and a clean exit removes its own file.
    What a process made under names without its pid (a rank's vLLM checkpoint, a client's ledger dir) its
    manifest (wb-owned-<pid>-*.txt) lists: gone with the pid too."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = os.getpid()
    made = {  # mkstemp/mkdtemp add 8 random characters
        "stale_file": tmp_path / f"wb-stacks-{dead.pid}-abcd_123.txt",
        "live_file": tmp_path / f"wb-stacks-{mine}-abcd_123.txt",
        "stale_dir": tmp_path / f"wb-tiny-1234abcd-r1-p{dead.pid}-xyz12345",
        "live_dir": tmp_path / f"wb-tiny-9-r0-p{mine}-xyz12345",
        "other": tmp_path / f"wb-ledger-x-r1-p{dead.pid}-xyz12345",  # a client's ledger dir: not an engine's
        "stale_vllm": tmp_path / "wb-vllm-deadbeef",  # listed by the dead pid's manifest
        "stale_ledger": tmp_path / "wb-ledger-x-1234abcd-deadbeef",
        "live_vllm": tmp_path / "wb-vllm-a11ve123",  # listed by a live pid's manifest
        "lease_dir": tmp_path / "wb-lease-deadbeef",  # listed, but its reaper's to remove
        "unlisted": tmp_path / "wb-vllm-unlisted",
    }
    for key, p in made.items():
        if key.endswith("file"):
            p.write_text("x")
        else:
            p.mkdir()
            (p / "inside").write_text("x")
    outside = tmp_path.parent / f"wb-outside-{dead.pid}"  # listed, not in the temp dir: never touched
    outside.mkdir(exist_ok=True)
    stale_manifest = tmp_path / f"wb-owned-{dead.pid}-abcd_123.txt"
    stale_manifest.write_text("".join(f"{made[k]}\n" for k in ("stale_vllm", "stale_ledger", "lease_dir"))
                              + f"{outside}\n{tmp_path / 'wb-already-gone'}\n")
    live_manifest = tmp_path / f"wb-owned-{mine}-abcd_123.txt"
    live_manifest.write_text(f"{made['live_vllm']}\n")
    code = ("import os, glob; from workbench.rank import stacks; p = stacks.install(); "
            "print(p, flush=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    kept = ("live_file", "live_dir", "other", "live_vllm", "lease_dir", "unlisted")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [made[k].name for k in kept] + [live_manifest.name])  # its own file and manifest went at exit too
    assert out.stdout.strip().startswith(str(tmp_path / "wb-stacks-")) and outside.is_dir()
    outside.rmdir()


def test_a_stopped_rank_is_reported_stopped_not_dead(fresh):
    """Issue 40: the event's kind said "died" while its message said "stopped ... not dead"; now both say
    stopped, and every reader of the kind treats it as a rank lost to the step, as a death (the cursor stays at
    the step, the hang's table names it; the diagnosis's dead-engine sentence says "was stopped")."""
    import signal

    s = fresh.session(TINY)
    assert s.step().ok
    pid = fresh.pids[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        frame = s.step()  # rank 1 misses its heartbeats while rank 0 waits for it in the all-reduce
    finally:
        os.kill(pid, signal.SIGCONT)
    msg = frame.rank_errors[1]
    assert "EngineStopped" in msg and f"kill -CONT {pid}" in msg and "not dead" in msg, msg
    assert msg.startswith("stopped ") and frame.ranks_with("stopped") == {1} and "died" not in frame.kinds, msg
    assert s.cursor == 1, s.cursor  # the step that lost a rank is the next to run, as after a death
    status = dict(zip(frame.hang.ranks["rank"], frame.hang.ranks["status"]))
    assert str(status[1]).startswith("stopped"), status  # the hang's table said "died"
    fresh.restart()


LOOP = wb.Scenario("python-loop-on-rank-1", probe=None)
LOOP.step(setup)


@LOOP.step
def spin(ctx) -> None:
    if ctx.rank == 1:
        while True:  # pure Python: no socket an abort could cut
            pass


LOOP.step(grow)  # a collective afterwards: the group works again


def test_a_rank_spinning_in_python_is_interrupted_by_recover_on_the_same_engines(fresh):
    pids = dict(fresh.pids)
    s = fresh.session(LOOP)
    assert s.step().ok
    s.deadline = 5.0
    frame = s.step()
    assert 1 in frame.rank_errors, frame.kinds  # past its deadline
    info = s.recover(wait=0)  # no waiting out the collective timeout: the control thread stops the loop
    assert info["action"] == "re-formed the process group on the same engines", info
    assert dict(fresh.pids) == pids
    assert s.steps[s.cursor] == "spin"  # the failed step keeps the cursor; skip it, or it spins again
    s.skip()
    after = s.step()
    assert after.ok and after.step == "grow", after.rank_errors
