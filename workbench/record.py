"""A finished (or paused) run as plain tables plus a manifest: what bundles and reports use.

A live Session and a loaded bundle both become ``RunRecord`` objects, so every view and
the HTML report go through one code path whatever the source.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from workbench import findings

if TYPE_CHECKING:
    from workbench.session import Session

SCHEMA_VERSION = 1


@dataclass
class RunRecord:
    manifest: dict[str, Any]
    tensors: pd.DataFrame
    outputs: pd.DataFrame
    events: pd.DataFrame
    notes: list[dict[str, Any]] = field(default_factory=list)
    trace: pd.DataFrame = field(default_factory=pd.DataFrame)  # forward-trace rows, all steps
    ledger: pd.DataFrame = field(default_factory=pd.DataFrame)  # collectives ledger, all steps and ranks

    @property
    def label(self) -> str:
        fix = self.manifest.get("fix")
        return f"fix: {fix}" if fix else "bug path"

    @property
    def steps(self) -> list[str]:
        return list(self.manifest.get("steps_run", []))

    def findings(self) -> pd.DataFrame:
        return findings.history_findings(self.tensors, self.outputs, self.events, trace=self.trace)

    @classmethod
    def from_session(cls, s: Session) -> RunRecord:
        c = s.cluster
        notes = [{"step": f.step, "rank": r, "note": n} for f in s.frames for r, ns in f.notes.items() for n in ns]
        manifest = {
            "schema": SCHEMA_VERSION,
            "scenario": s.scenario.name,
            "title": s.scenario.title,
            "incident": s.scenario.incident,
            "fix": s.fix,
            "fixes": dict(s.scenario.fixes),
            "poison": s.poison,
            "params": {k: v for k, v in s.params.items()},
            "steps": s.steps,
            "steps_run": [f.step for f in s.frames],
            "hangs": [f.hang.to_dict() for f in s.frames if getattr(f, "hang", None) is not None],
            "elapsed": [{str(r): t for r, t in f.elapsed.items()} for f in s.frames],
            "ranks": c.world_size,
            "backend": c.backend,
            "devices": {str(r): d for r, d in c.devices.items()},
            "timeout_s": c.timeout,
            "seed": s.params.get("seed"),
            "started_at": s.started_at,
            "saved_at": time.time(),
            "versions": versions(),
        }
        return cls(manifest, s.history, s.outputs, s.events, notes, trace=s.trace, ledger=s.ledger)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "ipyparallel", "workbench", "plotly", "pandas"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "absent"
    return out
