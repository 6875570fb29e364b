"""Weight-sync order and cycles from a run's notes and outputs: which names got whose bytes.

The weight-sync scenarios note, on the sender, the receiver's plan and the sender's stream
as JSON (``order:{"kind": "plan"|"stream", "stage": n, "entries": [[name, dtype, shape,
(chunk)], ...]}``). The packed broadcast carries bytes only, so what a receiver loads
under plan entry *i* is whatever bytes sit at plan offset *i* in the stream: comparing
the two lists is enough to say which names got whose bytes, on live sessions and on
saved records alike (no engines, no tensors).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

ORDER_NOTE = "order:"
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}


def _notes(source: Any) -> list[str]:
    """Note strings from a session, a record, a frame, a list of note dicts or strings."""
    if hasattr(source, "record") and callable(source.record):
        source = source.record()
    if hasattr(source, "notes"):
        source = source.notes
    if isinstance(source, dict):  # a frame's {rank: [notes]}
        return [n for ns in source.values() for n in ns]
    return [n["note"] if isinstance(n, dict) else str(n) for n in source or []]


def orders(source: Any) -> dict[tuple[str, int], pd.DataFrame]:
    """``{(kind, stage): table}``; a table has one row per tensor: index, name, dtype, shape, chunk, offset, nbytes."""
    out: dict[tuple[str, int], pd.DataFrame] = {}
    for note in _notes(source):
        if not note.startswith(ORDER_NOTE):
            continue
        doc = json.loads(note[len(ORDER_NOTE):])
        out[(doc["kind"], int(doc["stage"]))] = order_frame(doc["entries"])
    return out


def order_frame(entries: list[list[Any]]) -> pd.DataFrame:
    """Entries ``[name, dtype, shape, (chunk)]`` as a table with byte offsets in the packed stream."""
    rows, offset = [], 0
    for i, e in enumerate(entries):
        name, dtype, shape = e[0], str(e[1]).replace("torch.", ""), list(e[2])
        n = math.prod(shape) * ITEMSIZE.get(dtype, 4)
        rows.append({"index": i, "name": name, "dtype": dtype, "shape": shape,
                     "chunk": e[3] if len(e) > 3 else None, "offset": offset, "nbytes": n})
        offset += n
    return pd.DataFrame(rows, columns=["index", "name", "dtype", "shape", "chunk", "offset", "nbytes"])


def first_mismatch(plan: pd.DataFrame, stream: pd.DataFrame) -> dict[str, Any] | None:
    """The first index where the stream's name differs from the plan's (or one list ends), else None."""
    for i in range(max(len(plan), len(stream))):
        p = plan["name"].iloc[i] if i < len(plan) else None
        s = stream["name"].iloc[i] if i < len(stream) else None
        if p != s:
            return {"index": i, "planned": p, "streamed": s}
    return None


def first_split(notes: Any) -> dict[str, Any] | None:
    """The earliest stage whose receiver plan and sender stream part: stage, index, planned and streamed
    names, how many planned names then hold other tensors' bytes, and the step whose notes showed it."""
    steps: dict[tuple[str, int], str | None] = {}
    for n in notes if isinstance(notes, list) else []:
        text = n.get("note") if isinstance(n, dict) else None
        if isinstance(text, str) and text.startswith(ORDER_NOTE):
            doc = json.loads(text[len(ORDER_NOTE):])
            steps.setdefault((doc["kind"], int(doc["stage"])), n.get("step"))
    found = orders(notes)
    for stage in sorted({st for _, st in found}):
        plan, stream = found.get(("plan", stage)), found.get(("stream", stage))
        if plan is None or stream is None:
            continue
        at = first_mismatch(plan, stream)
        if at is None:
            continue
        pv = provenance(plan, stream)
        return {**at, "stage": stage, "wrong": int((~pv["own"]).sum()), "names": len(pv),
                "step": steps.get(("stream", stage)) or steps.get(("plan", stage)),
                "dtype_planned": plan["dtype"].iloc[at["index"]] if at["index"] < len(plan) else None,
                "dtype_streamed": stream["dtype"].iloc[at["index"]] if at["index"] < len(stream) else None}
    return None


def provenance(plan: pd.DataFrame, stream: pd.DataFrame) -> pd.DataFrame:
    """Per plan entry: the stream tensors whose bytes land in it, and whether it got its own bytes.

    Columns: index, name, dtype, offset, nbytes, own (its own name's bytes, whole and alone),
    holds (``"lm_head.weight[0:32 B] + ..."``: stream names with the byte ranges taken).
    """
    rows = []
    end = int((stream["offset"] + stream["nbytes"]).max()) if len(stream) else 0
    for p in plan.itertuples():
        lo, hi = p.offset, p.offset + p.nbytes
        parts = []
        for s in stream[(stream["offset"] < hi) & (stream["offset"] + stream["nbytes"] > lo)].itertuples():
            a, b = max(lo, s.offset) - s.offset, min(hi, s.offset + s.nbytes) - s.offset
            parts.append((s.name, a, b, s.nbytes))
        own = len(parts) == 1 and parts[0][0] == p.name and parts[0][1] == 0 and parts[0][2] == parts[0][3]
        holds = " + ".join(n if (a, b) == (0, whole) else f"{n}[{a}:{b} B]" for n, a, b, whole in parts)
        if hi > end:
            holds += " + <past the end of the stream>"
        rows.append({"index": p.index, "name": p.name, "dtype": p.dtype, "offset": lo, "nbytes": p.nbytes,
                     "own": own, "holds": holds})
    return pd.DataFrame(rows, columns=["index", "name", "dtype", "offset", "nbytes", "own", "holds"])


def misloaded(plan: pd.DataFrame, stream: pd.DataFrame) -> list[str]:
    """Sentences: ``'model.norm.weight' (float32) got bytes of lm_head.weight[..]``, one per wrong name."""
    pv = provenance(plan, stream)
    return [f"{r.name!r} ({r.dtype}) got {r.holds}" for r in pv.itertuples() if not r.own]


def sync_cycles(runs: dict[str, Any]) -> pd.DataFrame:
    """Per run label and sync: the worker's log-prob gap and how many names hold wrong bytes.

    ``runs``: ``{label: outputs table}`` (``session.outputs`` or ``record.outputs``), taking the
    rows of the ``score*`` steps; a sync with no score (a rank died, a step hung) is absent.
    """
    rows = []
    for label, out in runs.items():
        if out is None or not len(out) or "step" not in out:
            continue
        scored = out[out["step"].astype(str).str.startswith("score")]
        for step, part in scored.groupby("step", sort=False):
            vals = {r["name"]: r for _, r in part.iterrows()}
            if "logprob_gap" not in vals:
                continue
            gap = vals["logprob_gap"]
            wrong = vals.get("names_wrong")
            rows.append({"run": label, "sync": int(gap.get("sync", 0) or 0), "step": step,
                         "logprob_gap": float(gap["head"][0]),
                         "names_wrong": None if wrong is None else int(wrong["head"][0]),
                         "names": None if wrong is None else int(wrong.get("names", 0) or 0)})
    return pd.DataFrame(rows, columns=["run", "sync", "step", "logprob_gap", "names_wrong", "names"])


def _sync_of(step: str) -> int:
    tail = str(step).rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 1


def match_table(runs: dict[str, Any], prefix: str = "inference.") -> pd.DataFrame:
    """Per run, sync and worker tensor: does it hold what the trainer holds (``ref_diff == 0``)?

    ``runs``: ``{label: tensors history}`` (``session.history`` or ``record.tensors``); the
    ``score*`` steps declare the trainer's values as expectations, so their rows carry
    ``ref_diff``. Columns: run, sync, step, name (without ``prefix``), match, ref_diff.
    """
    rows = []
    for label, hist in runs.items():
        if hist is None or not len(hist) or "ref_diff" not in hist:
            continue
        part = hist[hist["step"].astype(str).str.startswith("score") & hist["name"].astype(str).str.startswith(prefix)]
        for r in part.itertuples():
            diff = r.ref_diff
            if diff is None or diff != diff:
                continue
            rows.append({"run": label, "sync": _sync_of(r.step), "step": r.step, "name": r.name[len(prefix):],
                         "match": float(diff) == 0.0, "ref_diff": float(diff)})
    return pd.DataFrame(rows, columns=["run", "sync", "step", "name", "match", "ref_diff"])
