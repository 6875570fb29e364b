"""The client stays light: reading a scenario's declaration and driving attached ranks imports no torch.

`workbench run --cluster P` is meant to take about a second on warm ranks; importing torch
(and FSDP with it) took over two of them. The steps run on the engines, which import what
they need; the client only needs names, fixes, parameters and the step functions as
references. Each check runs in a fresh interpreter, so nothing this test process imported counts.
(A whole attached run, group formation included, is checked in tests/test_attach.py.)
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import cloudpickle

from workbench import scenarios
from workbench.rank.byname import RankFn

# What `workbench run SCENARIO --cluster P` imports before it talks to a rank, every catalogue
# scenario resolved, the attach and session layers loaded.
CLIENT = """
import json, sys
import workbench.cli
from workbench import scenarios
import workbench.live.connect, workbench.live.session, workbench.postmortem.bundle, workbench.analysis.findings
import workbench.job.shard  # the capture's module: what an attach, the site hook and a capture-off job import
decl = {n: (s.step_names, sorted(s.fixes)) for n in scenarios.names() for s in [scenarios.get(n)]}
print(json.dumps({"decl": decl, "loaded": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
"""


def _client_modules() -> dict:
    out = subprocess.run([sys.executable, "-c", CLIENT], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_scenario_declarations_and_the_attach_path_import_no_torch():
    doc = _client_modules()
    assert set(doc["decl"]) == set(scenarios.names())
    assert doc["decl"]["fsdp1-rotary-meta-init"] == [["load", "cast", "wrap_fsdp1", "forward"],
                                                     ["cast-params-only", "fp32-everywhere", "recompute-after-wrap",
                                                      "sync-buffers-after-wrap"]]
    assert "torch.distributed.fsdp" not in doc["loaded"], "a scenario declaration pulls in FSDP on the client"
    assert doc["loaded"] == [], f"the client imports torch: {doc['loaded'][:5]}"


def test_step_functions_travel_by_reference():
    """The engines import a step's module by name: the function must be that module's attribute, so
    cloudpickle sends a reference, not the code (a closure or a local def would go by value)."""
    for name in scenarios.names():
        for step, fn in scenarios.get(name).steps:
            assert pickle.loads(cloudpickle.dumps(fn)) is fn, f"{name}: step {step} does not pickle by reference"


def test_rank_fn_ships_without_importing_its_module():
    code = ("import sys, cloudpickle\nfrom workbench.rank.byname import RankFn\n"
            "blob = cloudpickle.dumps(RankFn('workbench.rank.remote', 'run_step'))\n"
            "print(len(blob), 'workbench.rank.remote' in sys.modules, 'torch' in sys.modules)")
    size, remote, torch = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                         text=True).stdout.split()
    assert (remote, torch) == ("False", "False")
    assert int(size) < 300  # two names, not the function's code
    join = pickle.loads(cloudpickle.dumps(RankFn("os.path", "join")))
    assert join("a", "b") == "a/b" and join.__name__ == "join"


def test_auto_backend_on_a_machine_without_a_gpu_driver_imports_no_torch():
    """A cold `workbench run` asks for backend 'auto': on a CPU box the answer is gloo, known without torch."""
    import os

    import pytest

    from workbench.rank.host import GPU_DRIVER_PATHS

    if any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        pytest.skip("a GPU driver is present: torch counts the GPUs")
    code = ("import sys\nfrom workbench.live.engines import resolve_backend\n"
            "print(resolve_backend('auto', 2), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["gloo", "False"]


# In a fresh interpreter: how many times importing ipyparallel through the workbench scans every installed
# distribution, and what it leaves behind.
IPP_SCANS = """
import importlib.metadata as md
scans = []
scan = md.distributions
md.distributions = lambda **kw: (scans.append(1), scan(**kw))[1]
from workbench.live import registry
ipp = registry.ipyparallel()
n = len(scans)
import ipyparallel.traitlets as traits
from ipyparallel.cluster.cluster import Cluster
fresh = {e.name.lower() for e in md.entry_points(group="ipyparallel.engine_launchers")}
helped = Cluster.class_traits()["engine_launcher_class"].help
print(n, traits.entry_points is md.entry_points, ipp.Client.__module__,
      sorted(fresh) == sorted(k for k in fresh if f"  - {k}: " in helped), len(fresh) > 3)
"""


def test_importing_ipyparallel_scans_the_installed_packages_once_and_leaves_its_lookup_live():
    """ipyparallel's launcher traits read their help (every installed package's entry points) twice each while
    its Cluster class is defined: four scans on every client start. The client's import scans once, and
    ipyparallel's own lookup is the live one afterwards, its help still listing every installed launcher."""
    out = subprocess.run([sys.executable, "-c", IPP_SCANS], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "True", "ipyparallel.client.client", "True", "True"], out.stdout + out.stderr
