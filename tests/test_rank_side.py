"""Rank-side modules that no other cheap test reaches by name: what each engine of the shared cluster holds.

``rank/state`` (the rank the group formed with, read by the probe without importing the group's machinery),
``rank/outstream`` (the engines' stdout and stderr, named by the engine launcher, never imported by the
client), ``rank/_probe_triton`` (the fused kernel, loaded only where CUDA tensors are probed), ``rank/stacks``
and ``rank/leftovers`` (the files a blocked or killed rank is read and cleared by), ``rank/warmup`` and the
client's ``live/lease``, and ``rank/probe_child`` with the ``rank/_probe_build`` child it starts. ``make check``
runs them on its one cluster (tests/test_check.py).
"""

from __future__ import annotations

import pytest


def _state() -> dict:
    from workbench.rank import state

    return {k: state.RANK.get(k) for k in ("rank", "world_size", "backend")}


def test_each_rank_holds_the_rank_its_group_formed_with(healthy):
    got = healthy.run(_state)
    assert got == {r: {"rank": r, "world_size": healthy.world_size, "backend": "gloo"}
                   for r in range(healthy.world_size)}


def _streams() -> list[str]:
    import sys

    return [f"{type(s).__module__}.{type(s).__qualname__}" for s in (sys.stdout, sys.stderr)]


def test_the_engines_print_through_the_quiet_stream(healthy):
    got = healthy.run(_streams)
    want = ["workbench.rank.outstream.QuietFlushStream"] * 2
    assert got == {r: want for r in range(healthy.world_size)}


def _probe_cpu_model() -> tuple[bool, bool, int]:
    import sys

    import torch
    from torch import nn

    from workbench.rank import probe

    triton_before = "triton" in sys.modules  # another test's work on this shared engine may have (torch._dynamo)
    rows = probe.probe_module(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to(torch.bfloat16), rank=0)
    return "workbench.rank._probe_triton" in sys.modules, "triton" in sys.modules and not triton_before, len(rows)


def test_probing_cpu_tensors_never_loads_the_triton_kernel(healthy):
    """The fused kernel's module imports triton (seconds, and a GPU compiler): on CPU tensors it stays unloaded, and
    the probe loads no triton of its own (the ledger's ``prepare`` imports torch._dynamo, which may load it: a
    shared engine that ran a ledger before has it already)."""
    got = healthy.run(_probe_cpu_model)
    assert all(not kernel and not triton and n >= 4 for kernel, triton, n in got.values()), got


def _own_files() -> tuple[bool, bool]:
    import os

    from workbench.rank import leftovers, stacks

    s, m = stacks.install(), leftovers.own_temp_paths()  # both made once, at group formation: the same paths
    return (os.path.isfile(s) and f"wb-stacks-{os.getpid()}-" in s,
            os.path.isfile(m) and f"wb-owned-{os.getpid()}-" in m)


def test_each_rank_has_its_stacks_file_and_a_manifest_of_its_temp_paths(healthy):
    """The file SIGUSR1 dumps a blocked rank's stacks into, and the manifest the next sweep clears a killed
    rank's temp paths by, both named after the engine's pid."""
    assert healthy.run(_own_files) == {r: (True, True) for r in range(healthy.world_size)}


def _warm() -> tuple[str | None, bool]:
    import os
    import sys

    from workbench.rank import warmup

    warmup.import_rank_layer()
    return os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"), "workbench.rank.context" in sys.modules


def test_a_warm_rank_has_the_rank_layer_and_no_hub_progress_bars(healthy):
    import os

    want = (os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1"), True)  # a user's own setting stands
    assert healthy.run(_warm) == {r: want for r in range(healthy.world_size)}


def test_every_engine_carries_the_clusters_lease_and_its_reaper_runs(healthy):
    """What ends the engines with their client: each carries the lease's marker in its environment."""
    import os

    from workbench.live import lease

    own = healthy._lease
    marked = {p.pid for p in lease.members(own.token)}
    assert set(healthy.run(os.getpid).values()) <= marked
    assert own.reaper is not None and own.reaper.poll() is None and os.path.isfile(own.file)


def test_the_probes_child_build_runs_once_and_says_why_it_built_nothing_without_cuda(monkeypatch, tmp_path):
    """``probe_child`` starts ``python -m workbench.rank._probe_build`` (the fused kernel's cold build, off the
    rank's threads) once per process; on a box without CUDA the child builds nothing and its line says why."""
    import torch

    from workbench.rank import probe_child

    if torch.cuda.is_available():
        pytest.skip("a CUDA box builds the kernel here; the GPU recordings read that")
    monkeypatch.setattr(probe_child, "_BUILD", {})
    for k in ("WORKBENCH_PROBE_CHILD_BUILD", "WORKBENCH_PROBE_WARM", "WORKBENCH_PROBE_FUSED"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold cache: a cached kernel needs no child
    assert probe_child.prebuild_probe(0) is True
    child = probe_child._BUILD["proc"]
    assert child.args[1:] == ["-m", "workbench.rank._probe_build", "0"]
    got = probe_child.await_prebuild(limit=120)
    assert got["warm"] is False and got["why"] == "no CUDA device" and child.returncode == 1, got
    assert probe_child.prebuild_probe(0) is True and "proc" not in probe_child._BUILD  # no second child
    assert probe_child.await_prebuild() is got
