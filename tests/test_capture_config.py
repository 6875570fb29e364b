"""The capture's configuration (``workbench/job/config.py``): the one reader of the ``WORKBENCH_CAPTURE*`` variables.

In process and fast: what ``workbench job`` writes reads back as it was; every bad value is said once, ignored and its
default used (the poison's no longer silently, the ledger's no longer differently); one set of OFF words.
"""

from __future__ import annotations

import ast
import os

import pytest

from workbench.job import config, hooks, shard
from workbench.job.config import CaptureConfig, Ledger, Poison

VARIABLES = [v for k, v in vars(config).items() if k.startswith("ENV") and isinstance(v, str)]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No capture variable of the runner's leaks in, and each test's say-once memory is its own."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(shard, "_SAID", set())


def test_an_empty_environment_is_every_default():
    got = CaptureConfig.from_env({})
    assert got == CaptureConfig() and not got.problems
    assert got.enabled and got.directory is None and got.ledger is None and got.poison is Poison.TO_EMPTY
    assert got.points == tuple(config.POINTS) and got.attach == "on-deadlock"


@pytest.mark.parametrize("made", [
    CaptureConfig(),
    CaptureConfig(directory="/runs/x", job="job-1", poison=Poison.ALL, ledger=Ledger.FULL, every=3,
                  points=("step", "to_empty"), attach="post-mortem", attach_deadline=12.5, hang_after=4.0, pid=77,
                  home="/src", launcher_pid=5, writer="inline"),
    CaptureConfig(enabled=False, poison=Poison.OFF, ledger=Ledger.OFF, attach=None),
    CaptureConfig(ledger=Ledger.CALLS, attach="on-error", writer="thread"),
])
def test_to_env_reads_back_as_it_was(made):
    env = made.to_env()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    assert set(env) <= set(VARIABLES), set(env) - set(VARIABLES)
    back = CaptureConfig.from_env(env)
    assert back == made and not back.problems


def test_what_the_command_line_sets_is_what_the_ranks_read(monkeypatch, tmp_path):
    """``workbench job`` execs the launcher with the environment ``to_env`` made: caught at the exec."""
    from workbench import cli

    seen = {}

    def execvpe(file, args, env):
        seen.update(env)
        raise OSError("stopped here")

    monkeypatch.setattr(os, "execvpe", execvpe)
    assert cli.main(["job", str(tmp_path / "run"), "--every", "2", "--points", "step", "--ledger", "full",
                     "--poison", "all", "--attach", "on-error", "--hang-after", "7", "--", "true"]) == 2
    got = CaptureConfig.from_env(seen)
    assert not got.problems
    assert (got.directory, got.every, got.points, got.ledger, got.poison, got.attach, got.hang_after) == (
        str((tmp_path / "run").resolve()), 2, ("step",), Ledger.FULL, Poison.ALL, "on-error", 7.0)
    assert got.launcher_pid == os.getpid() and got.pid is None and got.job and got.home


@pytest.mark.parametrize("name, raw, field, default", [
    (config.ENV_POISON, "to-empty", "poison", Poison.TO_EMPTY),
    (config.ENV_LEDGER, "cals", "ledger", None),
    (config.ENV_EVERY, "x", "every", None),
    (config.ENV_EVERY, "-2", "every", None),
    (config.ENV_POINTS, "step,warp", "points", tuple(config.POINTS)),
    (config.ENV_ATTACH, "always", "attach", "on-deadlock"),
    (config.ENV_DEADLINE, "0", "attach_deadline", 600.0),
    (config.ENV_HANG_AFTER, "soon", "hang_after", 60.0),
    (config.ENV_PID, "me", "pid", None),
    (config.ENV_WRITER, "fast", "writer", None),
])
def test_each_bad_value_is_kept_as_one_problem_and_its_default_used(name, raw, field, default):
    got = CaptureConfig.from_env({name: raw})
    assert getattr(got, field) == default
    assert list(got.problems) == [name] and f"{name}={raw!r}" in got.problems[name]


@pytest.mark.parametrize("name, raw, key, default", [
    (config.ENV_POISON, "bogus", "poison", "to_empty"),
    (config.ENV_EVERY, "three", "every", None),
    (config.ENV_HANG_AFTER, "-1", "hang_after", 60.0),
])
def test_the_automatic_points_say_a_bad_value_once_and_go_on_with_the_default(name, raw, key, default, capfd):
    for _ in range(3):  # read as often as the rank reads it: said once
        assert hooks.options({name: raw})[key] == default
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"{name}={raw!r}" in err and "ignored" in err, err


def test_a_bad_ledger_in_the_environment_is_said_once_and_the_scripts_own_stands(monkeypatch, capfd):
    monkeypatch.setenv(config.ENV_LEDGER, "everything")
    for _ in range(2):
        assert shard._ledger_mode(config.from_env(), "calls", strict=False) == "calls"
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "WORKBENCH_CAPTURE_LEDGER='everything'" in err, err
    with pytest.raises(ValueError, match="WORKBENCH_CAPTURE_LEDGER"):  # strict mode raises what the default says
        shard._ledger_mode(config.from_env(), "calls", strict=True)


def test_reading_says_nothing_itself(capfd):
    """A process that only asks whether it captures (the launcher's, a rank's workers) stays quiet."""
    env = {config.ENV: "/runs/x", config.ENV_POISON: "bogus", config.ENV_EVERY: "x"}
    assert hooks.directory(env) == "/runs/x"
    assert config.from_env(env).problems
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("word", ["", *config.OFF, *config.ON, "OFF", " True "])
def test_a_word_is_no_directory(word):
    got = CaptureConfig.from_env({config.ENV: word})
    assert got.directory is None and hooks.directory({config.ENV: word}) is None
    assert got.enabled == (word.strip().lower() not in config.OFF)


def test_the_off_words_switch_off_the_capture_the_ledger_and_the_poison():
    for word in config.OFF:
        assert not CaptureConfig.from_env({config.ENV: word}).enabled
        assert Ledger.of_word(word) is Ledger.OFF and Poison.of_word(word) is Poison.OFF
        assert CaptureConfig.from_env({config.ENV_ATTACH: word}).attach is None
    for word in config.ON:
        assert Ledger.of_word(word) is Ledger.FULL  # the full ledger, as "1" always meant
    assert set(config.OFF) < set(config.WORDS) and set(config.ON) < set(config.WORDS)
    assert hooks.OFF is config.WORDS


def test_the_site_hook_knows_the_same_words():
    """The site hook may import only os and sys: its own copy of the words must be these."""
    with open(os.path.join(os.path.dirname(hooks.__file__), "site", "sitecustomize.py")) as f:
        tree = ast.parse(f.read())
    words = [tuple(e.value for e in node.elts) for node in ast.walk(tree) if isinstance(node, ast.Tuple)
             and node.elts and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)]
    assert words == [config.WORDS], f"sitecustomize.py's words {words} differ from config.WORDS"


def test_the_modes_keep_what_the_manifest_records():
    assert [m.arg for m in Poison] == ["to_empty", True, False]
    assert [m.arg for m in Ledger] == ["calls", True, False]
    assert Ledger.of_arg(True) is Ledger.FULL and Poison.of_arg(True) is Poison.ALL
    assert Ledger.of_arg("off") is None and Poison.of_arg("everything") is None  # the keyword API's own words
    assert Ledger.of_word("Default") is Ledger.CALLS and Ledger.of_word("bogus") is None


def test_one_check_of_the_point_names():
    assert config.check_points(["step", "forward"]) == ("step", "forward")
    with pytest.raises(ValueError, match="unknown point\\(s\\) warp"):
        config.check_points(["step", "warp"])
    with pytest.raises(ValueError, match="unknown point\\(s\\) warp"):
        hooks.Hooks(None, points=["warp"])
    assert hooks.POINTS is config.POINTS


def test_the_launchers_pid_is_the_name_triggers_reads():
    from workbench.job import triggers

    assert config.ENV_LAUNCHER == triggers.ENV_LAUNCHER


def test_by_default_a_gpu_job_takes_a_point_every_step_and_a_cpu_job_after_its_first(tmp_path, monkeypatch):
    """Unset, ``--every`` is ``auto`` (issue 62): a GPU rank's point costs about 2% of its step, so one every
    step; a CPU rank's costs more than its step at a real size, so the first step's only. A number says it."""
    import torch

    import workbench.job as wj

    class OnGpu(torch.Tensor):  # a CPU tensor that says it is on a GPU: what the default reads of the optimizer's
        is_cuda = property(lambda self: True)

    cap = wj.capture(tmp_path / "cap", ledger=False, poison=False)
    try:
        assert CaptureConfig.from_env({}).every is None and CaptureConfig.from_env({config.ENV_EVERY: "auto"}) \
            == CaptureConfig()
        taken: list[str] = []
        for every, device, steps in ((None, "cpu", ["step1"]), (None, "gpu", ["step1", "step2", "step3"]),
                                     (0, "gpu", ["step1"]), (2, "cpu", ["step1", "step2"])):
            hk = hooks.Hooks(cap, every=every)  # not installed: its step hook called as torch calls it
            monkeypatch.setattr(hk, "point", lambda name, module, outputs=None: taken.append(name))
            p = torch.ones(2)
            opt = torch.optim.SGD([p.as_subclass(OnGpu) if device == "gpu" else p], lr=0.1)
            for _ in range(3):
                hk._stepped(opt)
            assert taken == steps, (every, device, taken)
            assert hk.followed()["every"] == (every if every is not None else (1 if device == "gpu" else 0))
            taken.clear()
        hk = hooks.Hooks(cap)  # one job, two optimizers: each by its own tensors
        monkeypatch.setattr(hk, "point", lambda name, module, outputs=None: taken.append(name))
        on_gpu, on_cpu = (torch.optim.SGD([t], lr=0.1) for t in (torch.ones(2).as_subclass(OnGpu), torch.ones(2)))
        for _ in range(3):
            hk._stepped(on_gpu)
            hk._stepped(on_cpu)
        assert taken == ["step1", "step1", "step2", "step3"], taken
        del on_gpu, on_cpu  # a job's optimizer is freed before the capture closes and records what it followed
        import gc

        gc.collect()
        assert hk.followed() == {"optimizer_steps": 3, "last_step_point": 3, "every": 1}, hk.followed()
    finally:
        cap.close()
