"""The probe's kernel built by NVRTC (``rank/_probe_nvrtc.py``): what a box without it does, and its contract.

The kernel itself runs only on a GPU: ``benchmarks/probe_nvrtc.py`` compares its rows with Triton's kernel
there, and ``tests/test_gpu_recordings.py`` re-reads that recording. Here: where NVRTC cannot build (this box has
no CUDA), the build says why once and the warm-up goes on to Triton's build; and the CUDA source keeps Triton's
kernel's arguments, in their order, so one ``Plan`` serves both.
"""

from __future__ import annotations

import re

import pytest
import torch

from workbench.rank import _probe_nvrtc, probe_fused

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path (a GPU runs the benchmark)")


def test_where_nvrtc_cannot_build_it_says_why_once_and_the_warm_up_goes_on_to_tritons(monkeypatch):
    monkeypatch.setattr(_probe_nvrtc, "_K", {})
    monkeypatch.setattr(probe_fused, "_WARM", {})
    monkeypatch.setenv("WORKBENCH_PROBE_CHILD_BUILD", "0")  # Triton's child build is another test's
    got = _probe_nvrtc.build(0, probe_fused.WORDS_PER_ITER, probe_fused.ITERS)
    assert got["nvrtc"] is False and got["why"], got
    assert _probe_nvrtc.build(0, probe_fused.WORDS_PER_ITER, probe_fused.ITERS) == got  # said once, not retried
    assert _probe_nvrtc.loaded() is None and not _probe_nvrtc.ready(torch.device("cuda", 0))
    monkeypatch.setattr(_probe_nvrtc, "_K", {})
    t = probe_fused.warm_async(torch.device("cuda", 0), plain_meanwhile=True)
    t.join(60)
    assert not t.is_alive()
    assert probe_fused._WARM["nvrtc"]["nvrtc"] is False  # tried first, and why it could not is kept
    assert probe_fused._WARM["phase"] in ("child", "load")  # then Triton's build, as before NVRTC
    assert probe_fused._WARM["result"]["warm"] is False and "kernel" not in probe_fused._WARM["result"]


def test_the_cuda_source_takes_tritons_arguments_in_their_order():
    triton_kernel = pytest.importorskip("workbench.rank._probe_triton").probe_all_kernel
    src = _probe_nvrtc.SOURCE % {"block": probe_fused.WORDS_PER_ITER, "iters": probe_fused.ITERS,
                                 "threads": _probe_nvrtc.THREADS}
    assert "%(" not in src
    sig = re.search(r'extern "C" __global__ void __launch_bounds__\(NT\) probe_all\((.*?)\)\s*\{', src, re.S)
    assert sig, "the kernel's entry point is gone"
    ours = [p.split()[-1].lstrip("*") for p in sig.group(1).split(",")]
    theirs = [a for a in triton_kernel.arg_names if a not in ("BLOCK", "ITERS", "HINT")]  # constants, baked in
    assert ours == theirs


_FAKE_NVRTC = r'''
import ctypes, json, sys, types
import torch
from torch.cuda import _utils

class FakeNvrtc:
    """NVRTC's C API as a successful compile answers it (this box has no libnvrtc): what it was asked is kept."""
    options = None
    compiles = 0
    def nvrtcCreateProgram(self, prog, source, name, *rest):
        prog._obj.value = 1
        return 0
    def nvrtcAddNameExpression(self, prog, name):
        return 0
    def nvrtcCompileProgram(self, prog, n, options):
        FakeNvrtc.options = [options[i].decode() for i in range(n)]
        FakeNvrtc.compiles += 1
        return 0
    def nvrtcGetCUBINSize(self, prog, size):
        size._obj.value = 4
        return 0
    def nvrtcGetCUBIN(self, prog, binary):
        ctypes.memmove(binary, b"CUBN", 4)
        return 0
    def nvrtcGetLoweredName(self, prog, name, lowered):
        lowered._obj.value = b"_Z9probe_allv"
        return 0
    def nvrtcDestroyProgram(self, prog):
        return 0

loaded = []
_utils._get_gpu_rtc_library = _utils._get_nvrtc_library = lambda: FakeNvrtc()
_utils._cuda_load_module = lambda binary, names: loaded.append(binary) or {n: ("kernel", n) for n in names}
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(major=9, minor=0)
torch.cuda.current_device = lambda: 0
def torch_build(source, name):  # torch's header search, as its _compile_kernel makes it first (no CUDA here)
    import torch.utils.cpp_extension
    return _utils._cuda_load_module(b"CUBN", ["_Z9probe_allv"])["_Z9probe_allv"]

torch.cuda._compile_kernel = torch_build
from workbench.rank import _probe_nvrtc

path, way = list(sys.path), sys.argv[1]
src = "extern \"C\" __global__ void probe_all() {}"
if way.startswith("precompiled"):  # the capture's compile as it opens (sm_90, or another GPU's sm_80), then the load
    _probe_nvrtc.precompile(src, {way.split("-")[1]}).join()
    before = FakeNvrtc.compiles
kernel = (_probe_nvrtc.compile_kernel(src, "probe_all", 0) if way != "torch"
          else _probe_nvrtc._torch_compile(src, "probe_all"))
print(json.dumps({"kernel": list(kernel), "binary": loaded[0].decode(), "options": FakeNvrtc.options,
                  "setuptools": "setuptools" in sys.modules, "path_same": sys.path == path,
                  "compiles": FakeNvrtc.compiles, "at_load": FakeNvrtc.compiles - before if way != "ours" and
                  way != "torch" else None}))
'''


@pytest.mark.parametrize("way", ["ours", "torch"])
def test_the_kernels_build_leaves_the_jobs_imports_and_path_alone(way, tmp_path):
    """The build runs on a thread of the job's process at its CUDA start. torch's ``_compile_kernel`` imports
    ``torch.utils.cpp_extension`` for CUDA's headers, and with it setuptools, which appends its ``_vendor`` folder to
    ``sys.path``: the job's own imports then saw setuptools' vendored packages (and raced ours). Ours asks NVRTC for
    the device's architecture alone (the source includes no header) and imports neither; torch's, kept for where ours
    is refused, gives ``sys.path`` back. This box has no CUDA: NVRTC's C API answers as a compile does, and torch's
    build is its header search's import alone (the real one: setuptools and its path entry)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "build.py"
    script.write_text(_FAKE_NVRTC)
    run = subprocess.run([sys.executable, str(script), way], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["kernel"] == ["kernel", "_Z9probe_allv"] and got["binary"].startswith("CUBN"), got
    assert got["path_same"] is True, got
    if way == "ours":
        assert got["options"] == ["--gpu-architecture=sm_90"] and got["setuptools"] is False, got
    else:  # what the thread did before: setuptools imported, its path entry now taken back out
        assert got["setuptools"] is True, got


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_a_capture_compiles_the_kernel_as_it_opens_and_cudas_init_only_loads_it(arch, tmp_path):
    """At cc51d85 the warm-up compiled at the job's CUDA init (0.58 s on a fresh H200) and the job's ``to_empty``
    point, soon after, took the plain path meanwhile: 529 ms. NVRTC needs no CUDA context, so the capture compiles
    as it opens for NVML's architecture, and the build at CUDA's init loads that cubin without a compile of its own.
    A GPU of another architecture (sm_80 made, sm_90 found) is compiled for at the load, as before."""
    import json
    import subprocess
    import sys

    script = tmp_path / "build.py"
    script.write_text(_FAKE_NVRTC)
    run = subprocess.run([sys.executable, str(script), f"precompiled-{arch}"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["kernel"] == ["kernel", "_Z9probe_allv"] and got["binary"].startswith("CUBN"), got
    assert got["at_load"] == (0 if arch == "sm_90" else 1), got
    assert got["options"] == ["--gpu-architecture=sm_90"] and got["setuptools"] is False, got


def test_nvml_names_every_gpus_architecture_without_cuda():
    """What the capture compiles for: every GPU's architecture as NVML reads it, NVML shut down after; nothing where
    NVML is absent or refuses (this box: no libnvidia-ml, so a CPU capture starts no compile)."""
    import ctypes

    from workbench.rank import _probe_nvrtc

    class FakeNvml:
        shut = 0

        def __init__(self, init: int = 0) -> None:
            self.init = init

        def nvmlInit_v2(self):
            return self.init

        def nvmlDeviceGetCount_v2(self, count):
            count._obj.value = 3
            return 0

        def nvmlDeviceGetHandleByIndex_v2(self, i, handle):
            handle._obj.value = i + 1
            return 0

        def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
            major._obj.value, minor._obj.value = (8, 0) if handle.value == 3 else (9, 0)
            return 0

        def nvmlShutdown(self):
            FakeNvml.shut += 1
            return 0

    assert _probe_nvrtc._nvml_archs(FakeNvml()) == {"sm_90", "sm_80"} and FakeNvml.shut == 1
    assert _probe_nvrtc._nvml_archs(FakeNvml(init=9)) == set()
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert _probe_nvrtc._nvml_archs() == set() and _probe_nvrtc.precompile("x") is None
