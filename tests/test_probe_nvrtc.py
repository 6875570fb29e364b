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
