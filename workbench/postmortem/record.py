"""A finished (or paused) run as plain tables plus a manifest: what bundles and reports use.

A live Session (``Session.record()``) and a loaded bundle both become ``RunRecord`` objects, so every view and
the HTML report go through one code path whatever the source.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.analysis import diagnosis, findings, flightrecorder
from workbench.rank.columns import KERNEL_KNOBS, cpu_model, kernel_knobs

SCHEMA_VERSION = 1
# What ``findings()`` and ``diagnose()`` raise on a record without the tables or columns they read (an old bundle,
# shards of a job cut short): a missing key or column, a None where a table was, a value of another type.
FINDINGS_FAULTS = (KeyError, IndexError, AttributeError, TypeError, ValueError)


def damage_faults() -> tuple[type[BaseException], ...]:
    """What a damaged file (a bundle's zip, a shard's JSON lines or Parquet) provokes in zip/zlib/pyarrow/json
    and the table checks after them, as opposed to a bug here: the read (OSError, EOFError), the zip (BadZipFile;
    RuntimeError/NotImplementedError for an encrypted member or an unknown compression), zlib's and struct's
    errors, a parse (ValueError: JSON, UTF-8, Arrow's ArrowInvalid), Arrow's own, and a field missing or of
    another type. Imported only when one of these is raised."""
    import struct
    import zipfile
    import zlib

    import pyarrow

    return (OSError, EOFError, zipfile.BadZipFile, RuntimeError, zlib.error, struct.error, ValueError,
            pyarrow.ArrowException, KeyError, IndexError, TypeError, AttributeError)


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
        if not fix and self.manifest.get("job"):  # a job's own capture has no fix paths, so no "bug path"
            return "the job"
        return f"fix: {fix}" if fix else "bug path"

    @property
    def steps(self) -> list[str]:
        return list(self.manifest.get("steps_run", []))

    def findings(self) -> pd.DataFrame:
        return findings.history_findings(self.tensors, self.outputs, self.events, trace=self.trace)

    def diagnose(self) -> diagnosis.Diagnosis:
        """The first cause of what went wrong in this run, in one sentence (``clean`` when nothing did)."""
        return diagnosis.diagnose(self)

    def to_flight_recorder(self, out_dir: str | os.PathLike, prefix: str = flightrecorder.DEFAULT_PREFIX) -> list[Path]:
        """This run's ledger as Flight Recorder dumps (one per rank), named for the backend it ran on, so
        PyTorch's own analyser (``torchfrtrace OUT_DIR``) can be pointed at a workbench run."""
        return flightrecorder.to_flight_recorder(self.ledger, out_dir, prefix, backend=self.manifest.get("backend"))


def versions(kernels: dict[str, str] | None = None) -> dict[str, str]:
    """What a rerun elsewhere may differ in. ``kernels``: the ranks' own kernel knobs (rank 0's, as its engine
    reported them at group formation); without them, this process's environment, which engines it starts inherit."""
    import importlib.metadata as md

    out = {"python": platform.python_version(), "cpu": _cpu()}
    for pkg in ("torch", "transformers", "ipyparallel", "workbench", "plotly", "pandas"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "absent"
    knobs = kernels if kernels is not None else kernel_knobs()
    return out | {k: knobs[k] for k in KERNEL_KNOBS if knobs.get(k)}  # the float kernels (SIMD width, oneDNN ISA)


def _cpu() -> str:
    """The CPU model: float kernels (and so the last bits of a forward) depend on it."""
    return cpu_model()
