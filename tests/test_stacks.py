"""The stacks users train with (DeepSpeed, Lightning Fabric, Accelerate), each as a user's own small script under
``workbench job`` on 2 CPU ranks with gloo (docs/stacks.md), and what the capture must never do inside them.

A right job exits 0, reads clean and prints what it prints without the workbench; a planted bug of that stack's
init path is named and the job exits as it does without the workbench. Each script runs once plain and once per
``--every`` under the wrapper; the assertions share those runs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
