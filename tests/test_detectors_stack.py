"""Detectors keyed on what every stack does (``workbench/job/materialise.py``, ``owners.py``): every ``to_empty``,
the module an optimizer steps, the user's module inside a wrapper.

The job: ``tests/jobs/meta_moe_job.py``, a small MoE built on meta and materialised as Megatron-FSDP 0.6.1 does it
(``m.to_empty(device=..., recurse=False)`` then ``m.reset_parameters()`` on each module holding a meta parameter),
its router's ``expert_bias`` registered with an explicit device inside the meta context (incident 001).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jobrun
import pytest
import torch
from torch import nn

from workbench.job import hooks, materialise, owners

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "meta_moe_job.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ENVS = ("WORKBENCH_CAPTURE", "WORKBENCH_JOB_ID", "WORKBENCH_CAPTURE_LEDGER", hooks.ENV_PID, hooks.ENV_EVERY,
        hooks.ENV_POINTS, hooks.ENV_ATTACH, hooks.ENV_POISON, hooks.ENV_DEADLINE)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENVS}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])})
    return env


def _job(out: Path, *args: str, every: int = 0) -> tuple[subprocess.CompletedProcess, str]:
    """The job under ``workbench job`` and its report's diagnosis line."""
    run = jobrun.run([sys.executable, "-m", "workbench.cli", "job", str(out), "--every", str(every), "--",
                      *TORCHRUN, str(JOB), *args], out, timeout=300, env=_env(), cwd=out.parent)
    report = subprocess.run([sys.executable, "-m", "workbench.cli", "report", str(out)], capture_output=True,
                            text=True, timeout=300, env=_env(), cwd=out.parent)
    line = next((ln for ln in report.stdout.splitlines() if ln.startswith("diagnosis:")), report.stdout + report.stderr)
    return run, line


# -- the job, as a user runs it ---------------------------------------------------------------------------
@pytest.mark.parametrize("every", [0, 1])
def test_module_by_module_materialisation_names_the_clobbered_buffer_and_the_to_empty(tmp_path, every):
    """No wrapper any hook knows, ``to_empty(recurse=False)`` only: the step point probes the model by module path,
    buffers included, and the sentence leads with the buffer to_empty replaced although it was real."""
    run, line = _job(tmp_path / "cap", "--wrap", "none", every=every)
    assert run.returncode == 0, run.stderr[-2000:]
    assert line.startswith("diagnosis: `layers.0.router.expert_bias` was real (zeros) before "
                           "`to_empty(recurse=False)` at meta_moe_job.py:"), line
    assert "replaced by memory nobody wrote" in line and "`layers.1.router.expert_bias`" in line, line
    assert "param0" not in line


def test_the_buffer_made_again_after_to_empty_reads_clean(tmp_path):
    run, line = _job(tmp_path / "cap", "--wrap", "none", "--fix", every=1)
    assert run.returncode == 0, run.stderr[-2000:]
    assert line.startswith("diagnosis: clean"), line


def test_under_ddp_the_forward_point_already_names_it(tmp_path):
    run, line = _job(tmp_path / "cap", "--wrap", "ddp")
    assert run.returncode == 0, run.stderr[-2000:]
    assert line.startswith("diagnosis: `layers.0.router.expert_bias` was real (zeros) before `to_empty"), line


# -- the watch itself, in this process ------------------------------------------------------------------
class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 3))
        self.register_buffer("bias", torch.zeros(4, device="cpu"))
        self.register_buffer("scale", torch.ones(2, device="cpu"))


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(3, 3), _Router())


def test_every_to_empty_keeps_what_was_real_and_returns_what_torch_returns():
    errors: list = []
    watch = materialise.Materialisations(lambda exc, where: errors.append(exc))
    undo = watch.install()
    try:
        model = _meta_model()
        router = model[1]
        got = router.to_empty(device="cpu", recurse=False)
        model[0].to_empty(device="cpu", recurse=False)
    finally:
        undo()
    assert got is router and not errors
    assert nn.Module.to_empty is not None and not getattr(nn.Module.to_empty, "__workbench_materialise__", False)
    said = {c.name: c for c in watch.clobbered}
    assert set(said) == {"bias", "scale"}  # the meta weight was materialised, not clobbered
    assert said["bias"].before == "zeros" and said["scale"].before == "all 1"
    assert said["bias"].call == "to_empty(recurse=False)" and said["bias"].user.startswith("test_detectors_stack.py:")
    notes = watch.notes(model)
    assert [n.split("`")[1] for n in notes] == ["1.bias", "1.scale"]
    assert notes[0].startswith(materialise.NOTE) and watch.notes(model) == []  # said once
    assert [type(m) for m in watch.roots()] == [_Router, nn.Linear]


def test_a_library_that_calls_to_empty_is_named_beside_the_users_line():
    """The library's line is the innermost installed package's frame, the user's the first frame of their own."""
    fake = "/opt/venv/lib/python3.11/site-packages/megalib/buffers.py"
    code = compile("def materialise(m):\n    return lines(sys._getframe(0))\n", fake, "exec")
    scope = {"lines": materialise.lines, "sys": sys}
    exec(code, scope)
    library, user = scope["materialise"](None)
    assert library == "megalib/buffers.py:2"
    assert user.startswith("test_detectors_stack.py:")


def test_a_failing_watch_leaves_the_call_to_the_job():
    errors: list = []
    watch = materialise.Materialisations(lambda exc, where: errors.append(where))
    watch._after = lambda *a: 1 / 0
    undo = watch.install()
    try:
        model = _meta_model()
        assert model.to_empty(device="cpu") is model
    finally:
        undo()
    assert errors == ["to_empty watch"] and not model[1].weight.is_meta


def test_describe_reads_zeros_constants_and_first_values():
    assert materialise.describe(torch.zeros(3)) == "zeros"
    assert materialise.describe(torch.full((3,), 2.5)) == "all 2.5"
    assert materialise.describe(torch.arange(6.0)) == "[0, 1, 2, 3, ...]"
    assert materialise.describe(torch.tensor([1, 2], dtype=torch.int64)) == "[1, 2]"


# -- owners -----------------------------------------------------------------------------------------------
class _UserHolder(nn.Module):  # a user's module with one child: never unwrapped (its names are the user's)
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.body = inner


class _Engine(nn.Module):  # a stack's wrapper: holds the module as `.module`, calls it
    def __init__(self, inner: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self.module = inner
        self.__dict__["optimizer"] = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_wrapper_is_what_holds_the_module_with_the_same_parameters():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    assert owners.unwrapped(_Engine(_Engine(net))) is net
    holder = _UserHolder(net)
    assert owners.unwrapped(holder) is holder
    extra = _Engine(net)
    extra.scale = nn.Parameter(torch.ones(1))  # a module with parameters of its own is no wrapper
    assert owners.unwrapped(extra) is extra


def test_the_optimizer_step_is_probed_as_the_topmost_module_that_owns_its_parameters():
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 1)))
    wrapped = _Engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert owners.owner(opt, [net[1]]) is net  # a known module holding only some of them is not the owner
    assert owners.owner(opt, []) is net
    flat = torch.nn.Parameter(torch.zeros(5))  # a ZeRO-like flat partition no module holds
    zero = torch.optim.SGD([flat], lr=0.1)
    engine = _Engine(nn.Linear(2, 2), optimizer=type("Wrapper", (), {"optimizer": zero})())
    assert owners.owner(zero, []) is engine.module
    assert wrapped.module is net



class _Walks:
    """Counts the walks of ``nn.Module.parameters`` (each a walk of the module tree: ~1 ms a Llama-1B on an H200
    host, three of them a step point before)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        real = nn.Module.parameters

        def counted(module, *a, **k):
            self.n += 1
            return real(module, *a, **k)

        monkeypatch.setattr(nn.Module, "parameters", counted)


def test_a_step_point_finds_its_module_without_walking_the_tree_again(monkeypatch):
    """The step hook asks for the optimizer's module at every step point: once found among the known models for
    the same parameters it is not looked for again (no walk); other parameters look again. A module that is no
    wrapper is not walked to say so."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 1)))
    other = nn.Linear(3, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    walks = _Walks(monkeypatch)
    assert owners.owner(opt, [other, net]) is net and walks.n > 0
    walks.n = 0
    assert owners.owner(opt, [other, net]) is net and owners.unwrapped(net) is net
    assert walks.n == 0, walks.n
    opt.add_param_group({"params": other.parameters()})  # now it steps parameters net does not hold
    owners.owner(opt, [other, net])
    assert walks.n > 0
    assert owners.unwrapped(_Engine(net)) is net  # a wrapper is still seen through

# -- the first non-finite loss ------------------------------------------------------------------------------
def _points(out: Path, rank: int) -> list[str]:
    import json

    return [json.loads(ln)["point"] for ln in (out / f"rank{rank}" / "points.jsonl").read_text().splitlines()
            if json.loads(ln).get("kind") == "point"]


def test_a_nonfinite_loss_goes_with_the_next_point_every_rank_takes(tmp_path):
    """Rank 0's loss is NaN at the second step: the step point after it carries the loss and says so, and every rank
    takes the ``nonfinite_loss`` point before the next backward (agreed over the store: rank 1's loss was finite),
    so the ranks' points stay paired. DDP: its all-reduce in each backward keeps the ranks within a backward."""
    run, line = _job(tmp_path / "cap", "--wrap", "ddp", "--fix", "--nan-at", "1", "--steps", "3", every=1)
    assert run.returncode == 0, run.stderr[-2000:]
    assert _points(tmp_path / "cap", 0) == _points(tmp_path / "cap", 1) == [
        "forward", "step1", "step2", "nonfinite_loss", "step3"]
    assert "nan from step `step2`" in line and "output `loss` on rank" in line, line


@pytest.mark.parametrize("skip", [False, True])
def test_every_rank_takes_a_point_after_the_first_nonfinite_loss_whatever_every_says(tmp_path, skip):
    """``--every 0``: no step point after step 1, yet rank 0's NaN loss at the second step takes a point on both
    ranks before the third backward, the loss with it. With every step after it skipped (a loss scaler's
    "OVERFLOW! Skipping step" on rank 0) the point still comes: it waits for no optimizer step."""
    args = ("--skip-nonfinite",) if skip else ()
    run, line = _job(tmp_path / "cap", "--wrap", "ddp", "--fix", "--nan-at", "1", "--steps", "3", *args, every=0)
    assert run.returncode == 0, run.stderr[-2000:]
    assert _points(tmp_path / "cap", 0) == _points(tmp_path / "cap", 1) == ["forward", "step1", "nonfinite_loss"]
    assert "`nonfinite_loss`" in line and "output `loss` on rank" in line, line  # rank 1's too, once the NaN spread


def test_the_loss_watch_reads_each_loss_once_and_steps_aside_after_the_first_bad_one():
    from workbench.job import losses

    taken: list = []
    watch = losses.Losses(lambda exc, where: None, take=lambda loss: taken.append((watch.backwards, loss.item())))
    undo = watch.install()
    try:
        w = torch.ones(2, requires_grad=True)
        (w * 2).sum().backward()
        watch.stepped()
        assert watch.due() is None
        (w * float("nan")).sum().backward()
        (w * 3).sum().backward()  # no optimizer step between: the stack skipped it
        outputs, note = watch.due()
        assert torch.isnan(outputs["loss"])
        assert note == ("nonfinite loss: backward() 2 ran from a loss that was nan, after optimizer step 1; the stack "
                        "then ran another backward without an optimizer step (a step skipped for overflow)")
        assert taken == [(3, 6.0)]  # one process: the point before the backward after the bad one, its loss
        (w * float("inf")).sum().backward()
        assert watch.due() is None and watch.found and watch.taken and len(taken) == 1
        assert w.grad is not None  # the job's own backward ran every time
    finally:
        undo()
    assert not getattr(torch.autograd.backward, "__workbench_losses__", False)


# -- clean means looked ---------------------------------------------------------------------------------------
def test_a_capture_that_probed_no_model_says_so_instead_of_clean(tmp_path):
    out = tmp_path / "cap"
    run = jobrun.run([sys.executable, "-m", "workbench.cli", "job", str(out), "--", *TORCHRUN,
                      str(ROOT / "tests" / "jobs" / "bare_params_job.py")], out, timeout=300, env=_env(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    report = subprocess.run([sys.executable, "-m", "workbench.cli", "report", str(out)], capture_output=True,
                            text=True, timeout=300, env=_env(), cwd=tmp_path)
    line = report.stdout.splitlines()[0]
    assert line.startswith("diagnosis: not looked: the capture probed only the optimizer's 1 flat tensor(s)"), line
    assert "clean" not in line


def test_an_optimizer_whose_parameters_name_their_model_is_probed_as_that_model():
    """Megatron-FSDP's distributed parameters carry ``_megatron_fsdp_model``: the optimizer's tensors no live module
    holds still lead to the model (unwrapped)."""
    net = nn.Linear(2, 2)
    wrapper = _Engine(net)
    flat = torch.nn.Parameter(torch.zeros(3))
    flat._megatron_fsdp_model = wrapper
    assert owners.owner(torch.optim.SGD([flat], lr=0.1), []) is net
