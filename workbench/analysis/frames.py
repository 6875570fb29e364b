"""Frames: what every rank held after one step, as pandas tables.

One vocabulary for notebooks, the CLI's JSON and bundles: the probe's column names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from workbench.errors import RankFailure
from workbench.rank.probe import COLUMNS
from workbench.rank.trace import TRACE_COLUMNS

EVENT_COLUMNS = ["rank", "kind", "error", "message", "traceback"]
OUTPUT_COLUMNS = [*COLUMNS, "ref_max_abs_diff"]
INT_COLUMNS = ["rank", "numel", "nan", "inf", "poisoned"]


def table(rows: list[dict[str, Any]], columns: list[str]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df.columns:
            df[c] = None
    for c in INT_COLUMNS:
        if c in df.columns:
            df[c] = df[c].astype("Int64")  # counts stay integers; meta rows get <NA>, not NaN
    extra = [c for c in df.columns if c not in columns]
    return df[columns + extra]


@dataclass
class Frame:
    """One step on every rank: tensors, outputs, per-rank failures, timings and notes."""

    step: str
    index: int
    scenario: str
    fix: str | None
    tensors: pd.DataFrame
    outputs: pd.DataFrame
    events: pd.DataFrame
    elapsed: dict[int, float] = field(default_factory=dict)
    notes: dict[int, list[str]] = field(default_factory=dict)
    trace: pd.DataFrame = field(default_factory=lambda: table([], TRACE_COLUMNS))  # forward trace rows
    ledger: pd.DataFrame = field(default_factory=pd.DataFrame)  # collectives this step issued, per rank
    hang: Any = None  # workbench.analysis.collectives.Hang when the step did not finish on every rank

    @classmethod
    def build(cls, step: str, index: int, scenario: str, fix: str | None,
              values: dict[int, dict[str, Any]], failures: dict[int, RankFailure]) -> Frame:
        tensors, outputs, events, trace = [], [], [], []
        elapsed, notes = {}, {}
        for rank in sorted(values):
            v = values[rank]
            tensors += v["tensors"]
            outputs += v["outputs"]
            trace += v.get("trace", [])
            elapsed[rank] = v["elapsed"]
            if v["notes"]:
                notes[rank] = v["notes"]
            if v["error"]:
                events.append({"rank": rank, "kind": "error", **v["error"]})
        for rank, f in sorted(failures.items()):
            events.append({"rank": rank, "kind": f.kind, "error": f.error, "message": f.message,
                           "traceback": f.traceback})
        return cls(step, index, scenario, fix, table(tensors, COLUMNS), table(outputs, OUTPUT_COLUMNS),
                   table(events, EVENT_COLUMNS).sort_values("rank", ignore_index=True), elapsed, notes,
                   table(trace, TRACE_COLUMNS))

    @property
    def rank_errors(self) -> dict[int, str]:
        """rank -> 'kind Error: message' for every rank that failed this step."""
        return {int(r.rank): f"{r.kind} {r.error}: {r.message}" for r in self.events.itertuples()}

    @property
    def ok(self) -> bool:
        return self.events.empty

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "index": self.index, "fix": self.fix,
            "rank_errors": {str(k): v for k, v in self.rank_errors.items()},
            "elapsed": {str(k): v for k, v in self.elapsed.items()},
            "notes": {str(k): v for k, v in self.notes.items()},
            "tensors": records(self.tensors), "outputs": records(self.outputs), "events": records(self.events),
            "trace": records(self.trace),
            "ledger": records(self.ledger), "hang": None if self.hang is None else self.hang.to_dict(),
        }

    def __repr__(self) -> str:
        ranks = sorted({int(r) for r in self.tensors["rank"]}) if len(self.tensors) else []
        errs = "; ".join(f"rank {r}: {m[:80]}" for r, m in self.rank_errors.items()) or "no errors"
        return f"<Frame {self.index}:{self.step} fix={self.fix} ranks={ranks} {len(self.tensors)} tensor rows, {errs}>"


def jsonable(v: Any) -> Any:
    """Strict-JSON value: non-finite floats become 'nan'/'inf'/'-inf', numpy values Python ones."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if v is None or v is pd.NA:
        return None
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()  # numpy scalars and arrays (Parquet gives arrays back for list columns)
        if isinstance(v, list):
            return [jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


def fmt(v: Any) -> str:
    """One short number for tables and hover text: 4 significant digits, 'nan' for missing."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    try:
        return f"{v:.4g}"
    except (TypeError, ValueError):
        return str(v)


def last_step(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the latest step in a stacked history (all of ``df`` when it has no steps)."""
    if df.empty or "step_index" not in df:
        return df
    return df[df["step_index"] == df["step_index"].max()]


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: jsonable(v) for k, v in row.items()} for row in df.to_dict(orient="records")]
