"""The workbench: step through distributed model init on live ranks and see every rank.

    import workbench as wb
    cluster = wb.start(ranks=2)
    s = cluster.session("fsdp1-rotary-meta-init")
    s.step(); s.run(); s.history; s.compare(fix="cast-params-only")
    cluster.stop()
"""

from workbench.cluster import Cluster, start
from workbench.errors import BundleError, ClusterError, RankErrors, UnknownName, WorkbenchError
from workbench.frames import Frame
from workbench.scenario import Scenario
from workbench.scenarios import names as scenario_names
from workbench.session import Comparison, Session

__version__ = "0.1.0"
__all__ = [
    "BundleError", "Cluster", "ClusterError", "Comparison", "Frame", "RankErrors", "Scenario",
    "Session", "UnknownName", "WorkbenchError", "scenario_names", "start",
]
