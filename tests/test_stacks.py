"""The stacks users train with (DeepSpeed, Lightning Fabric and its Trainer, Accelerate, transformers' Trainer),
each as a user's own small script under ``workbench job`` on 2 CPU ranks with gloo (docs/stacks.md), and what the
capture must never do inside them.

A right job exits 0, reads clean and prints what it prints without the workbench; a planted bug of that stack's
init path is named and the job exits as it does without the workbench. Each script runs once plain and once per
``--every`` under the wrapper; the assertions share those runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from conftest import free_port
from jobrun import EXIT_ABORT, exit_abort
from test_job_zero_code import JOB, JOBS, TORCHRUN, _env, _run, _says
from torch import nn

import workbench as wb
from workbench.rank import poison, probe, probe_cpu


# -- the capture never stops an owner resizing the memory it read ----------------------------------------------
def _resizable(t: torch.Tensor) -> bool:
    return t.untyped_storage().resizable()


@pytest.mark.parametrize("case", ["alone", "batched", "poisoned", "nan", "bf16"])
def test_a_probe_leaves_every_storage_it_read_resizable(case):
    """``Tensor.numpy()`` marks a storage not resizable for good; the probe's host reads must not use it on a
    tensor it does not own (each case is one of the CPU pass's paths: a batch of one read in place, a batch of
    many, the plain path for the poison or a NaN, a 2-byte float widened)."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    tensors = {"a": torch.randn(16, dtype=dtype)} if case == "alone" else {
        n: torch.randn(8, 4, dtype=dtype) for n in ("a", "b", "c")}
    if case == "poisoned":
        poison.poison_(tensors["b"])
    if case == "nan":
        tensors["b"][0, 0] = float("nan")
    rows = probe.probe_dict(tensors, rank=0)
    assert len(rows) == len(tensors) and all(r["numel"] == t.numel() for r, t in zip(rows, tensors.values()))
    mid = rows[len(rows) // 2]  # "b", where the poison or the NaN is
    assert (mid["poisoned"] == 32) == (case == "poisoned") and (mid["nan"] == 1) == (case == "nan")
    assert all(_resizable(t) for t in tensors.values()), {n: _resizable(t) for n, t in tensors.items()}
    for t in tensors.values():
        t.untyped_storage().resize_(0)  # what FSDP2's free_storage does


def test_host_reads_a_tensor_as_numpy_would_without_marking_it():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    got = probe_cpu.host(t)
    assert got.tolist() == t.reshape(-1).tolist() and got.dtype.name == "float32"
    assert probe_cpu.host(t, "uint8").tobytes() == t.numpy().tobytes()  # the same bytes (this marks t, not below)
    u = torch.arange(6, dtype=torch.float32)
    view = probe_cpu.host(u)
    u[0] = 7.0  # no copy: the array is the tensor's memory
    assert view[0] == 7.0 and _resizable(u)
    assert probe_cpu.host(torch.arange(6.0).reshape(2, 3).t()).tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    assert probe_cpu.host(torch.empty(0)).size == 0


def test_fsdp2_frees_what_a_forward_point_probed():
    """Lightning's FSDP2 job under ``--every 1`` died in its first backward ("Trying to resize storage that is not
    resizable", FSDP2's ``free_unsharded_param``): the ``forward`` point probed the root's unsharded parameters,
    one of them never written (the poison, so the plain path), and that read marked its storage. The same here
    on one gloo rank: a point after forward, then backward (FSDP2 frees the root's unsharded parameters)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        poison.poison_(model[1].weight.data)  # LlamaRMSNorm's weight after Fabric's to_empty: never written
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        out = model(torch.ones(2, 8))
        rows = {r["name"]: r for r in probe.probe_module(model, rank=0)}
        assert rows["1.weight"]["poisoned"] == 8 and rows["2.weight"]["poisoned"] == 0
        out.sum().backward()  # raised before: the root's unsharded parameters could not be freed
        assert model[1].weight.grad is not None
    finally:
        dist.destroy_process_group()


# -- each stack as a user's own script under `workbench job` ----------------------------------------------------
class Stack(NamedTuple):
    script: str
    bug: str  # the flag that plants the stack's init-path bug
    bug_job: list[str]  # the workbench flags its bug runs under
    env: dict[str, str]


STACKS = {
    # DS_ACCELERATOR: DeepSpeed's CPU accelerator, told (it guesses from installed packages otherwise). Its buffer's
    # memory comes from torch.empty inside zero.Init, no to_empty: the default poison (what to_empty hands out)
    # leaves it the allocator's, which may be anything, zeros on both ranks included; `--poison all` makes it NaN.
    "deepspeed": Stack("stack_deepspeed.py", "--unwritten-buffer", ["--every", "0", "--poison", "all"],
                       {"DS_ACCELERATOR": "cpu"}),
    "lightning": Stack("stack_lightning.py", "--empty-init", ["--every", "1"], {}),  # it crashed under --every 1
    "accelerate": Stack("stack_accelerate.py", "--forget-inv-freq", ["--every", "0"], {}),
    # transformers imports DeepSpeed where it is installed, and DeepSpeed then prints a timed line on stdout
    # unless its accelerator is named
    "trainer": Stack("stack_trainer.py", "--forget-inv-freq", ["--every", "0"], {"DS_ACCELERATOR": "cpu"}),
}
NEEDS_D = "needs the stack-agnostic detectors (issue 60)"
NOT_YET: set[str] = set()  # stacks whose planted bug waits for those detectors


def _launch(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One run, again only where it met torch's exit abort (``test_job_zero_code._run``)."""
    return _run(cmd, cwd, timeout=600, env=_env(**env))


@pytest.fixture(scope="module", params=sorted(STACKS))
def stack(request, tmp_path_factory) -> dict[str, Any]:
    """One stack's five runs, shared by its tests: its script right and with the bug, plain (torchrun alone), and
    under ``workbench job`` (right with ``--every 0`` and ``1``, the bug with the stack's own flags)."""
    name = request.param
    s = STACKS[name]
    tmp = tmp_path_factory.mktemp(name)
    ext = tmp / "torch_extensions"  # where DeepSpeed would JIT-build an op: must stay empty
    env = {**s.env, "TORCH_EXTENSIONS_DIR": str(ext)}
    script = str(JOBS / s.script)
    runs: dict[str, Any] = {"name": name, "tmp": tmp, "ext": ext}
    for label, args in (("right", []), ("bug", [s.bug])):
        runs[f"plain {label}"] = _launch([*TORCHRUN, script, *args], tmp, env)
    for label, flags, args in (("right 0", ["--every", "0"], []), ("right 1", ["--every", "1"], []),
                               ("bug", s.bug_job, [s.bug])):
        out = tmp / label.replace(" ", "")
        runs[label] = (out, _launch([*JOB, str(out), *flags, "--", *TORCHRUN, script, *args], tmp, env))
    return runs


def test_only_torchs_exit_abort_is_run_again():
    """The rerun forgives that one trap and nothing else: a job that fails, or aborts for another reason, counts."""
    trap = "Signal 6 (SIGABRT) received by PID 7"
    cases = {(1, f"{EXIT_ABORT}\n... {trap}"): True, (0, EXIT_ABORT): False,
             (1, f"Traceback ...\nRuntimeError: boom\n{trap}"): False, (1, f"{EXIT_ABORT}\nexitcode: 1"): False}
    for (rc, err), want in cases.items():
        assert exit_abort(subprocess.CompletedProcess([], rc, "", err)) == want, (rc, err)


def _losses(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if re.match(r"step \d+ loss ", ln)]


@pytest.mark.slow
def test_a_right_job_exits_0_reads_clean_and_prints_as_without_the_workbench(stack):
    plain = stack["plain right"]
    assert plain.returncode == 0 and len(_losses(plain.stdout)) == 3, _says(plain)
    for label in ("right 0", "right 1"):
        out, run = stack[label]
        assert run.returncode == 0, (label, _says(run))
        assert run.stdout == plain.stdout, (label, run.stdout, plain.stdout)  # the same losses, nothing added
        d = wb.load(out).bug.diagnose()
        assert d.clean, (label, d.sentence)
    out, _ = stack["right 1"]
    report = _run([sys.executable, "-m", "workbench.cli", "report", str(out), "-o", str(stack["tmp"] / "r.html")],
                  stack["tmp"], timeout=300)
    assert report.returncode == 0 and "diagnosis: clean" in report.stdout, report.stdout + report.stderr


@pytest.mark.slow
def test_a_right_jobs_capture_read_the_models_values(stack, request):
    """Clean means looked and found nothing: every point on the model read each rank's own values of it (ZeRO-3's
    modules hold empty parameters; their values are in the optimizer's flat partitions)."""
    if stack["name"] in NOT_YET:
        request.applymarker(pytest.mark.xfail(strict=False, reason=NEEDS_D))
    t = wb.load(stack["right 1"][0]).bug.tensors
    head = t[t["name"].str.endswith("lm_head.weight")]
    assert set(head["rank"]) == {0, 1} and len(head) >= 4, head[["rank", "step", "name", "numel"]]
    assert (head["numel"] > 0).all() and head["fingerprint"].str.fullmatch(r"[0-9a-f]{16}").all(), (
        head[["rank", "step", "name", "numel", "fingerprint"]].to_string())
    if stack["name"] == "deepspeed":  # ZeRO-3: each rank reads its own partition, a shard; the buffers stay whole
        assert (head["agree"] == "").all() and head["agree_by"].str.contains("ZeRO-3 partition").all(), (
            head[["rank", "step", "agree", "agree_by"]].to_string())
        assert (head.groupby("step")["fingerprint"].nunique() == 2).all()  # two ranks, two different partitions
        scale = t[t["name"].str.endswith("logit_scale")]
        assert len(scale) == len(head) and (scale["agree"] == "0,1").all(), scale[["rank", "agree"]].to_string()


@pytest.mark.slow
def test_a_group_held_past_the_jobs_destroy_is_said(stack):
    """Why a job that reads clean may still exit 1 (``jobrun.exit_abort``): DeepSpeed's parameters hold the world
    group past the job's ``destroy_process_group``, and the report says who holds it; the other stacks let it go."""
    for label in ("right 0", "right 1"):
        d = wb.load(stack[label][0]).bug.diagnose()
        said = "the world group outlived the job's `destroy_process_group`" in d.sentence
        if stack["name"] == "deepspeed":
            assert d.clean and said and "objects' `ds_process_group`" in d.sentence, (label, d.sentence)
            assert "on ranks 0,1" in d.sentence and "terminate called without an active exception" in d.sentence
        elif stack["name"] == "trainer":  # two references past the Trainer and its model, in nothing gc tracks
            assert d.clean and said and "none that the garbage collector can name" in d.sentence, (label, d.sentence)
        else:
            assert not said, (label, d.sentence)


@pytest.mark.slow
def test_a_planted_bug_leaves_the_job_as_without_the_workbench(stack):
    plain = stack["plain bug"]
    _, run = stack["bug"]
    assert run.returncode == plain.returncode == 0, (_says(plain), _says(run))
    # the same lines; only what memory nobody wrote held may differ (the poison), so the losses' values may
    assert len(_losses(run.stdout)) == len(_losses(plain.stdout)) == 3, (run.stdout, plain.stdout)


@pytest.mark.slow
def test_a_planted_bug_is_named(stack, request):
    if stack["name"] in NOT_YET:
        request.applymarker(pytest.mark.xfail(strict=False, reason=NEEDS_D))
    d = wb.load(stack["bug"][0]).bug.diagnose()
    assert not d.clean, d.sentence
    if stack["name"] == "deepspeed":  # ZeRO-3 built in zero.Init: a buffer made by torch.empty, never filled
        assert "logit_scale" in d.sentence, d.sentence
        return
    ev = d.evidence
    at = set(ev[ev["step"] == "to_empty"]["what"])
    want = {"model.model.rotary_emb.inv_freq", "model.model.rotary_emb.original_inv_freq"}
    if stack["name"] == "lightning":  # init_module(empty_init=True): the modules without reset_parameters()
        want |= {"model.model.norm.weight", *(f"model.model.layers.{i}.{n}.weight" for i in (0, 1)
                                               for n in ("input_layernorm", "post_attention_layernorm"))}
    assert d.mechanism == "never-written" and d.step == "to_empty" and at == want, (d.sentence, sorted(at))
    parts = d.tensor.split(".")  # the sentence names it by as much of its path as tells it apart
    assert d.tensor in want and any(f"`{'.'.join(parts[i:])}`" in d.sentence for i in range(len(parts))), (
        d.tensor, d.sentence)
    assert "never written after materialisation at step `to_empty`" in d.sentence, d.sentence


@pytest.mark.slow
def test_no_run_built_a_deepspeed_op(stack):
    """DeepSpeed JIT-builds its CPU shared-memory all-reduce on first use (99 s) unless told not to: no run may."""
    runs = [v[1] if isinstance(v, tuple) else v for k, v in stack.items() if k.startswith(("plain", "right", "bug"))]
    assert len(runs) == 5
    for run in runs:
        assert "deepspeed_shm_comm" not in run.stdout + run.stderr, _says(run)
    assert not stack["ext"].exists() or not any(stack["ext"].iterdir()), sorted(stack["ext"].rglob("*"))[:5]


def test_megatron_fsdp_imports_on_cpu_and_materialises_module_by_module():
    """Megatron-FSDP runs on CUDA only (its proof is a GPU recording); on CPU its code is imported and read: the
    release in the lock still gives each meta-built module memory alone (``to_empty(recurse=False)``) and then
    rewrites only what that module's ``reset_parameters`` writes, the mechanism its recording shows."""
    import importlib.metadata
    import inspect
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Transformer Engine or Apex here: it says so and falls back
        import megatron_fsdp
        from megatron_fsdp import param_and_grad_buffer

    assert importlib.metadata.version("megatron-fsdp") == "0.6.1"
    assert callable(megatron_fsdp.fully_shard_model) and callable(megatron_fsdp.fully_shard_optimizer)
    source = inspect.getsource(param_and_grad_buffer)
    at = source.index("m.to_empty(device=self.device, recurse=False)")
    assert "m.reset_parameters()" in source[at: at + 1200]


# -- DeepSpeed ZeRO-1/2: a replica the engine holds, its buffers never synced by DeepSpeed ---------------------
STATS = JOBS / "stack_deepspeed_stats.py"


@pytest.fixture(scope="module")
def zero12(tmp_path_factory) -> dict[str, Any]:
    """``stack_deepspeed_stats.py`` under ``workbench job --every 1``: right at ZeRO-1, with its bug (each rank its
    own data statistics in buffers) at ZeRO-1 and ZeRO-2."""
    tmp = tmp_path_factory.mktemp("zero12")
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(tmp / "torch_extensions")}
    runs = {}
    for label, args in (("right 1", ["--stage", "1"]), ("bug 1", ["--stage", "1", "--per-rank-stats"]),
                        ("bug 2", ["--stage", "2", "--per-rank-stats"])):
        out = tmp / label.replace(" ", "")
        runs[label] = (out, _launch([*JOB, str(out), "--every", "1", "--", *TORCHRUN, str(STATS), *args], tmp, env))
    return runs


@pytest.mark.slow
def test_a_zero1_job_reads_clean_having_compared_its_replica(zero12):
    """Clean means looked: the engine's module is a replica across its data-parallel group, parameters and
    buffers compared across the ranks at every point."""
    out, run = zero12["right 1"]
    assert run.returncode == 0 and len(_losses(run.stdout)) == 4, _says(run)
    assert wb.load(out).bug.diagnose().clean
    t = wb.load(out).bug.tensors
    assert {"model.body.0.weight", "model.mean", "model.std"} <= set(t["name"]), sorted(set(t["name"]))
    assert (t["agree"] == "0,1").all(), t[["rank", "step", "name", "agree", "agree_by"]].to_string()
    by = dict(zip(t["name"], t["agree_by"]))
    assert by["model.body.0.weight"] == "DeepSpeed ZeRO-1 replica", by
    assert "DeepSpeed broadcasts parameters only" in by["model.mean"], by


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_per_rank_buffers_under_zero12_are_named(zero12, stage):
    """DeepSpeed broadcasts the parameters at ``initialize``, never the buffers: statistics each rank computed
    from its own shard of the data differ on rank 1, and that is what the report says (it read "clean")."""
    out, run = zero12[f"bug {stage}"]
    assert run.returncode == 0 and len(_losses(run.stdout)) == 4, _says(run)
    d = wb.load(out).bug.diagnose()
    assert not d.clean and d.tensor in ("model.mean", "model.std"), d.sentence
    assert "rank 1" in d.sentence and "`mean`" in d.sentence, d.sentence
    assert f"DeepSpeed ZeRO-{stage} replica, but DeepSpeed broadcasts parameters only" in d.sentence, d.sentence


ENGINE_RULE = """
import json, logging, os, warnings
import deepspeed, deepspeed.ops, torch
from torch import nn
from workbench.rank import agree
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore")
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo")
said = {}
for label, mark in (("plain", None), ("expert", "allreduce"), ("optimized", "ds_optim_param")):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    if mark:  # after initialize: an expert's needs DeepSpeed's MoE groups, which one rank has not
        setattr(engine.module[0].weight, mark, False)
    said[label] = agree._wrapper(engine)
print(json.dumps(said))
"""


@pytest.mark.slow
def test_deepspeeds_engine_is_a_replica_unless_some_parameter_is_a_ranks_own(tmp_path):
    """The engine's rule, on a real engine (one gloo rank): its module a replica at ZeRO-2, buffers said never
    synced; with an expert parameter (``allreduce=False``) or an ``OptimizedLinear`` shard (``ds_optim_param``)
    DeepSpeed itself does not broadcast, so the rule says nothing and the collectives speak."""
    env = _env(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "-c", ENGINE_RULE], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert run.returncode == 0, _says(run)
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["plain"] == [[0], "DeepSpeed ZeRO-2 replica", "DeepSpeed ZeRO-2 replica, but DeepSpeed broadcasts "
                             "parameters only: a buffer is never synced"], said
    assert said["expert"] is None and said["optimized"] is None, said


@pytest.mark.slow
def test_a_lightning_trainer_job_its_own_launcher_started(tmp_path):
    """Lightning's ``Trainer(devices=2)`` run as ``python train.py``: Lightning starts rank 1 itself and gives no one
    ``RANK`` (each rank's capture starts as it joins its group). Right: the plain run's stdout, clean, both ranks
    captured. With the clip under ``is_global_zero``: the job prints what it prints alone, and rank 1 is named as
    parting from rank 0's replica at the first step."""
    script = str(JOBS / "stack_pl_trainer.py")
    plain = _run([sys.executable, script], tmp_path)
    right = _run([*JOB, str(tmp_path / "right"), "--", sys.executable, script], tmp_path)
    assert plain.returncode == right.returncode == 0 and right.stdout == plain.stdout, _says(right)
    assert (tmp_path / "right" / "rank1").is_dir(), _says(right)
    d = wb.load(tmp_path / "right").bug.diagnose()
    assert d.clean, d.sentence
    bug_plain = _run([sys.executable, script, "--clip-on-zero"], tmp_path)
    bug = _run([*JOB, str(tmp_path / "bug"), "--", sys.executable, script, "--clip-on-zero"], tmp_path)
    assert bug.returncode == bug_plain.returncode == 0 and bug.stdout == bug_plain.stdout, _says(bug)
    d = wb.load(tmp_path / "bug").bug.diagnose()
    assert not d.clean and d.ranks == [1] and d.step == "step1", d.sentence
    assert "DDP replica" in d.sentence, d.sentence
