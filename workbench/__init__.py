"""The workbench: step through distributed model init on live ranks and see every rank.

    import workbench as wb
    cluster = wb.start(ranks=2)
    s = cluster.session("fsdp1-rotary-meta-init")
    s.step(); s.run(); s.history; s.compare(fix="cast-params-only")
    print(wb.diff("runs/good", "runs/bad"))   # two captures of a job: where they first part
    cluster.stop()

Client names load lazily: engines import ``workbench.rank`` through this package and
must not pay for (or depend on) pandas, plotly or ipywidgets.
"""

from __future__ import annotations

import importlib
from typing import Any

from workbench.errors import BundleError, ClusterError, RankErrors, UnknownName, WorkbenchError
from workbench.scenario import Scenario

__version__ = "0.1.0"

_LAZY = {
    "Cluster": ("workbench.live.cluster", "Cluster"),
    "start": ("workbench.live.cluster", "start"),
    "connect": ("workbench.live.connect", "connect"),
    "Session": ("workbench.live.session", "Session"),
    "sweep": ("workbench.live.sweep", "sweep"),
    "Comparison": ("workbench.live.session", "Comparison"),
    "Frame": ("workbench.analysis.frames", "Frame"),
    "scenario_names": ("workbench.scenarios", "names"),
    "load": ("workbench.postmortem.bundle", "load"),
    "diff": ("workbench.postmortem.diff", "diff"),
    "Bundle": ("workbench.postmortem.bundle", "Bundle"),
    "Stepper": ("workbench.live.stepper", "Stepper"),
    "viz": ("workbench.viz", None),
    "findings": ("workbench.analysis.findings", None),
    "report": ("workbench.postmortem.report", None),
    "bundle": ("workbench.postmortem.bundle", None),
    "collectives": ("workbench.analysis.collectives", None),
    "teach": ("workbench.teach", None),
    "replicated": ("workbench.rank.agree", "replicated"),
}

__all__ = ["BundleError", "ClusterError", "RankErrors", "Scenario", "UnknownName", "WorkbenchError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value
