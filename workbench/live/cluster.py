"""The cluster: the notebook's desk on top of the engines.

``Engines`` starts ranks and runs functions on them; ``Cluster`` adds what a user drives
from a notebook: sessions of a scenario and free-form ``%%px`` cells. Sessions take the
engines they run on; the engines never know about sessions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workbench.errors import ClusterError
from workbench.live.engines import Engines, ipp_faults, ship_by_value
from workbench.live.session import Session


class Cluster(Engines):
    """N live ranks (see ``Engines``) plus sessions and ``%%px`` helpers."""

    # A step running past a second shows a live status line (which ranks are done, who waits in which
    # collective; live/progress.py). False turns it off for every session; a session's own setting wins.
    progress: bool | Callable[[str], Any] = True

    def session(self, scenario: Any, fix: str | None = None, poison: bool = True, **params: Any) -> Session:
        return Session(self, scenario, fix=fix, poison=poison, params=params)

    # -- free-form %%px cells ------------------------------------------------------------
    def activate(self) -> None:
        """Register ``%px`` / ``%%px`` for these engines and give each cell ``torch``, ``dist``,
        ``wbr`` (``workbench.rank.phases``), ``rank``, ``world_size`` and ``device``."""
        self._check_usable()
        self._fresh_group()
        view = self._client[self._ids]
        view.activate()
        self._execute("import torch\nimport torch.distributed as dist\nfrom workbench.rank import phases as wbr\n"
                      "rank, world_size, device = wbr.here()")

    def push(self, **objects: Any) -> None:
        """Make client objects (a model class, a config) visible to ``%%px`` cells on every rank."""
        import cloudpickle

        self._check_usable()
        for obj in objects.values():
            ship_by_value(obj)
        # One cloudpickle blob, not ipyparallel's own canning: that rebuilds a class and its
        # methods separately, and zero-argument super() then fails on the engines.
        view = self._client[self._ids]
        self._wait(view.push({"_wb_blob": cloudpickle.dumps(objects)}, block=False), "push")
        self._execute("import cloudpickle as _wb_cp\nglobals().update(_wb_cp.loads(_wb_blob))\ndel _wb_blob")

    def probe(self, *names: str) -> Any:
        """Probe variables that ``%%px`` cells defined on every rank: one DataFrame, rows only.

        Runs in the engines' own namespace, so whatever a cell named ``model`` is found
        there; only the probe's small rows come back, never the tensors.
        """
        from workbench.analysis.frames import COLUMNS, table

        self._check_usable()
        view = self._client[self._ids]
        spec = repr(list(names))
        self._execute("from workbench.rank import phases as _wbr\n"
                      f"_wb_rows = _wbr.probe_rows({{_n: globals()[_n] for _n in {spec} if _n in globals()}})")
        rows = [row for per_rank in self._wait(view.pull("_wb_rows", block=False), "pull") for row in per_rank]
        missing = set(names) - {r["name"].split(".")[0] for r in rows}
        if missing:
            raise ClusterError(f"no variable(s) {sorted(missing)} on the engines (define them in a %%px cell)")
        return table(rows, COLUMNS)

    def _fresh_group(self) -> None:
        """A step that failed in a collective (a released deadlock cuts the group's sockets) leaves the group
        unusable: free-form cells get a fresh one, as the next session would."""
        if self.dirty:
            self.form_group()

    def _execute(self, code: str) -> None:
        self._fresh_group()
        self._wait(self._client[self._ids].execute(code, block=False), "execute")

    def _wait(self, ar: Any, what: str) -> Any:
        """An ipyparallel result under the cluster's deadline: a clear error, never a hung kernel."""
        try:
            return ar.get(timeout=self.deadline)
        except TimeoutError:  # ipyparallel's is the builtin
            for r in range(self.world_size):
                self._busy[r] = ar
            raise ClusterError(f"{what} on the engines did not finish within {self.deadline:g}s; "
                               "cluster.recover() brings the ranks back") from None
        except ipp_faults() as exc:
            raise ClusterError(f"{what} on the engines failed: {exc}") from None


def start(ranks: int = 2, backend: str = "auto", timeout: float = 60.0, port: int | None = None,
          env: dict[str, str] | None = None, progress: bool | Callable[[str], Any] = True) -> Cluster:
    """Start ``ranks`` engines and form their process group (the notebook's first cell).

    ``progress=False``: no live status line while a long step waits (see ``Cluster.progress``).
    """
    cluster = Cluster(ranks=ranks, backend=backend, timeout=timeout, port=port, env=env)
    cluster.progress = progress
    return cluster.start()
