"""What the capture reads of the job's tensors on the host leaves their storage resizable: ``Tensor.numpy()`` marks
a storage not resizable for good, and FSDP2 frees an unsharded parameter by resizing its storage to 0. The
fed-inputs digest (``agree._digest``) and the forward trace's CPU pass (``trace._nonfinite_host``,
``trace._out_stats_host``) read the job's own tensors, so each must go through ``probe_cpu.host``."""

from __future__ import annotations

import hashlib

import pytest
import torch

from workbench.rank import agree, trace


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(8, 4, dtype=dtype), torch.randn(16, dtype=dtype)]


def _freed(ts: list[torch.Tensor]) -> None:
    for t in ts:
        t.untyped_storage().resize_(0)  # what FSDP2's free_storage does; raised where a read marked it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fed_inputs_digest_leaves_the_storage_resizable(dtype):
    ts = _tensors(dtype)
    h = hashlib.sha256()
    agree._digest({"x": ts[0], "y": (ts[1], 3)}, h)
    again = hashlib.sha256()
    agree._digest({"x": ts[0].clone(), "y": (ts[1].clone(), 3)}, again)
    assert h.hexdigest() == again.hexdigest()  # the same values, the same digest
    ts[1][0] = 5.0
    other = hashlib.sha256()
    agree._digest({"x": ts[0], "y": (ts[1], 3)}, other)
    assert other.hexdigest() != h.hexdigest()  # the bytes were read
    _freed(ts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_the_trace_host_pass_leaves_the_storage_resizable(dtype):
    ts = _tensors(dtype)
    ts[0][0, 0] = float("nan")
    nonfinite = trace._nonfinite_host(ts)
    stats = trace._out_stats_host(ts)
    assert nonfinite is not None and float(nonfinite) == 1.0
    assert stats is not None and stats[0].item() == 1.0  # one NaN counted
    ts[1][3] = 2.0
    assert not torch.equal(trace._out_stats_host(ts)[4:], stats[4:])  # the fingerprint read the bytes
    _freed(ts)
