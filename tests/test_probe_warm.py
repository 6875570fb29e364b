"""The GPU probe's warm-up (without it the first GPU probe takes seconds: 4.8 s, Triton's import and compile) and the
NCCL release's abort that leaves torch's group registry alone, on CPU.

The warm-up runs the fused kernel through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag
is read when the kernel is defined); it must change no row. The abort is checked on stand-in groups: every
group's backend aborted, newest first, inside one NCCL group call, and nothing unregistered.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.rank import control

ROOT = Path(__file__).resolve().parents[1]


class _Backend:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def _group_start(self) -> None:
        self.calls.append("group_start")

    def _group_end(self) -> None:
        self.calls.append("group_end")


class _Group:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def abort(self) -> None:
        self.calls.append(f"abort {self.name}")

    def _get_backend(self, device):
        return _Backend(self.calls)


def test_abort_groups_aborts_each_backend_inside_one_group_call():
    calls: list[str] = []
    world, sub = _Group("0", calls), _Group("1", calls)
    registry = {world: "0", sub: "1"}
    before = dict(registry)
    n = control.abort_groups(sorted(registry, key=registry.get, reverse=True), world)
    assert n == 2
    assert calls == ["group_start", "abort 1", "abort 0", "group_end"]
    assert registry == before  # the registry is the caller's, untouched


def test_abort_groups_closes_the_group_call_when_an_abort_raises():
    calls: list[str] = []
    world = _Group("0", calls)

    class Broken(_Group):
        def abort(self) -> None:
            raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        control.abort_groups([Broken("1", calls), world], world)
    assert calls == ["group_start", "group_end"]


def test_no_warm_up_on_a_cpu_rank():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert control.warm_probe() is False


def _interpreted() -> None:
    """Run with TRITON_INTERPRET=1: the warm-up through the interpreter, and a probe's rows unchanged by it."""
    import pickle

    import torch
    from torch import nn

    from workbench.rank import probe, probe_fused

    probe_fused.FUSED_DEVICES = ("cuda", "cpu")
    probe_fused.WORDS_PER_ITER, probe_fused.ITERS = 256, 2
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(nn.Linear(48, 40), nn.Linear(40, 6)).to(torch.bfloat16)
    m.register_buffer("f", torch.randn(700, generator=g))
    cold = pickle.dumps(probe.probe_module(m, 0))
    probe._PLANS.clear()
    os.environ.pop("WORKBENCH_PROBE_WARM", None)
    t = probe_fused.warm_async("cpu")
    assert t is not None and probe_fused.warm_async("cpu") is t  # once per process
    probe_fused.await_warm()
    r = probe_fused._WARM["result"]
    assert r["warm"] is True and r["device"] == "cpu", r
    assert probe_fused.warm_async("cpu") is None  # done: not again
    assert pickle.dumps(probe.probe_module(m, 0)) == cold
    print("warm rows identical")


def test_warm_up_builds_the_kernel_and_changes_no_row():
    pytest.importorskip("triton")
    code = f"import runpy; runpy.run_path({str(Path(__file__))!r}, run_name='__interpreted__')"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "warm rows identical" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


if __name__ == "__interpreted__":
    _interpreted()


def test_a_capture_starts_the_kernels_build_when_the_job_initialises_cuda(tmp_path, monkeypatch):
    """The capture queues the probe kernel's build for the job's CUDA initialisation (``torch.cuda._lazy_call``), so
    the first point after ``to_empty`` need not take the plain path while NVRTC builds. A capture closed by then
    starts nothing, and nothing the queued call meets may fail the job's CUDA initialisation (torch raises a
    queued call's error from ``_lazy_init``). On CPU: torch's queue and the build are stand-ins, recorded."""
    import torch

    import workbench.job as wj
    from workbench.job import shard
    from workbench.rank import probe_fused

    for k in ("WORKBENCH_CAPTURE", "WORKBENCH_CAPTURE_PID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(shard, "_SAID", set())
    queued: list = []
    built: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_call", queued.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # inside the job's set_device(1): not set yet
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(probe_fused, "warm_async", lambda *a, **kw: built.append((a, kw)))

    cap = wj.capture(tmp_path / "open", ledger=False, poison=False)
    assert len(queued) == 1 and built == []  # queued, not started: CUDA is not initialised yet
    queued[-1]()  # the job initialises CUDA
    assert built == [((torch.device("cuda", 1),), {"plain_meanwhile": True})]  # the rank's own GPU, not GPU 0
    cap.close()
    queued[-1]()
    assert len(built) == 1  # closed since: nothing started

    def broken(*a, **kw):
        raise RuntimeError("a build that cannot start")

    monkeypatch.setattr(probe_fused, "warm_async", broken)
    cap = wj.capture(tmp_path / "broken", ledger=False, poison=False)
    queued[-1]()  # must not raise into the job's _lazy_init
    cap.close()


def test_the_warm_up_at_cudas_start_loads_on_the_ranks_own_gpu():
    """CUDA starts inside a job's first ``set_device(local_rank)``, where the current device still reads 0: the
    warm-up made a context on GPU 0 from rank 1 and loaded the kernel for ``cuda:0`` only (2 x H200,
    ``scripts/gpu_warm_device.sh``). Inside CUDA's start it takes the launcher's local rank; where CUDA had started
    before the capture, the device the job made current."""
    from workbench.job.capture_points import warm_index

    assert warm_index(False, 0, 1, 2) == 1  # rank 1's first CUDA call was set_device(1): not GPU 0
    assert warm_index(False, 0, 3, 1) == 0  # each rank sees only its own GPU (CUDA_VISIBLE_DEVICES per rank)
    assert warm_index(False, 0, 5, 4) == 1
    assert warm_index(True, 2, 0, 4) == 2  # CUDA up before the capture: the job's own current device
    assert warm_index(False, 0, 0, 0) == 0
