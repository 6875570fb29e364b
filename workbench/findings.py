"""Findings across ranks: what differs, what is broken, and on which rank.

Pure functions of frame tables, so a live session and a loaded bundle get the same
answers. Each detector returns rows ``(step, severity, rank, name, finding)``.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

STATUSES = ["ok", "sharded", "meta", "differs", "dtype", "inf", "nan", "poison", "missing"]
FINDING_COLUMNS = ["step", "severity", "rank", "name", "detector", "finding"]


def _rank0(tensors: pd.DataFrame, reference_rank: int = 0) -> pd.DataFrame:
    return tensors[tensors["rank"] == reference_rank].set_index("name")


def status(tensors: pd.DataFrame, reference_rank: int = 0) -> pd.DataFrame:
    """One status per (rank, tensor): the worst thing the rank's copy shows.

    ``poison``: NaN that is still the bit pattern ``to_empty`` was filled with (never
    written); ``nan``/``inf``: non-finite values; ``dtype``/``differs``: not what the
    reference rank holds for a tensor every rank should hold whole.
    """
    if tensors.empty:
        return pd.DataFrame(columns=["rank", "name", "status", "detail"])
    ref = _rank0(tensors, reference_rank)
    out = []
    for row in tensors.itertuples(index=False):
        st, detail = "ok", ""
        r0 = ref.loc[row.name] if row.name in ref.index else None
        if row.is_meta:
            st, detail = "meta", "on the meta device: no data"
        elif _count(row.poisoned) > 0:
            st, detail = "poison", f"{row.poisoned} of {row.numel} elements never written since to_empty"
        elif _count(row.nan) > 0:
            st, detail = "nan", f"{row.nan} NaN of {row.numel}"
        elif _count(row.inf) > 0:
            st, detail = "inf", f"{row.inf} Inf of {row.numel}"
        elif r0 is None:
            st, detail = "missing", f"rank {reference_rank} has no such tensor"
        elif row.rank != reference_rank and r0["dtype"] != row.dtype:
            st, detail = "dtype", f"{row.dtype} here, {r0['dtype']} on rank {reference_rank}"
        elif row.rank != reference_rank and r0["numel"] != row.numel:
            st, detail = "sharded", f"{row.numel} elements here, {r0['numel']} on rank {reference_rank}"
        elif row.rank != reference_rank and not r0["is_meta"] and r0["fingerprint"] != row.fingerprint:
            st, detail = "differs", f"content differs from rank {reference_rank}"
        out.append({"rank": row.rank, "name": row.name, "status": st, "detail": detail})
    return pd.DataFrame(out)


def _count(v: object) -> int:
    return 0 if v is None or v is pd.NA or v != v else int(v)


# -- detectors ----------------------------------------------------------------------
def rank_failures(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    return [{"severity": "error", "rank": int(e.rank), "name": "", "detector": "failure",
             "finding": f"{e.kind}: {e.error}: {str(e.message)[:300]}"} for e in events.itertuples()]


def dtype_split(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """Tensors whose dtype is not the same on every rank."""
    rows = []
    for name, g in tensors.groupby("name", sort=False):
        if g["dtype"].nunique() > 1:
            per = ", ".join(f"{d} on rank {','.join(str(r) for r in gg['rank'])}" for d, gg in g.groupby("dtype"))
            rows.append({"severity": "warning", "rank": None, "name": name, "detector": "dtype split",
                         "finding": f"dtype differs across ranks: {per}"})
    return rows


def divergence(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """Per rank, the tensors whose status is not ok, summarised to one line."""
    st = status(tensors)
    rows = []
    for (rank, s), g in st[~st["status"].isin(["ok", "meta", "sharded"])].groupby(["rank", "status"]):
        names = list(g["name"])
        rows.append({"severity": "error" if s in ("nan", "poison", "inf") else "warning", "rank": int(rank),
                     "name": names[0], "detector": f"status {s}",
                     "finding": f"{len(names)} tensor(s) {s}: {_some(names)}"})
    return rows


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


def output_health(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """Non-finite outputs, outputs that depart from the reference, or from rank 0."""
    rows = []
    if outputs.empty:
        return rows
    ref = _rank0(outputs)
    for o in outputs.itertuples(index=False):
        if _count(o.nan) > 0:
            rows.append({"severity": "error", "rank": int(o.rank), "name": o.name, "detector": "outputs",
                         "finding": f"{o.nan} of {o.numel} values NaN"})
        diff = getattr(o, "ref_max_abs_diff", None)
        if diff is not None and diff == diff and diff > 1e-3:
            rows.append({"severity": "error", "rank": int(o.rank), "name": o.name, "detector": "reference",
                         "finding": f"max |output - reference| = {diff:.3g}"})
        elif o.rank != 0 and o.name in ref.index and ref.loc[o.name]["fingerprint"] != o.fingerprint:
            rows.append({"severity": "warning", "rank": int(o.rank), "name": o.name, "detector": "outputs",
                         "finding": "differs from rank 0"})
    return rows


DETECTORS: list[Callable[..., list[dict]]] = [rank_failures, dtype_split, divergence, output_health]


def findings(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for detect in DETECTORS:
        for row in detect(step, tensors, outputs, events):
            rows.append({"step": step, **row})
    return pd.DataFrame(rows, columns=FINDING_COLUMNS)


def history_findings(tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Findings of every step of a run, from its stacked tables (``step`` column)."""
    parts = []
    steps = list(dict.fromkeys(tensors["step"])) if "step" in tensors else []
    for step in dict.fromkeys(steps + (list(events["step"]) if "step" in events else [])):
        def pick(df, s=step):
            return (df[df["step"] == s].drop(columns=["step", "step_index"]) if "step" in df else df)
        parts.append(findings(step, pick(tensors), pick(outputs), pick(events)))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=FINDING_COLUMNS)
