"""Colocated weight sync, read back from the probe tables: which name holds whose tensor.

The weight-sync scenarios probe, on every rank, ``trainer.<name>`` (the tensors trainer
rank ``r`` exports, native dtypes), ``sent.<name>`` (the same after the sync's cast) and
``worker<w>.<name>`` (what inference worker ``w``, hosted by that rank, now holds under each
HF name). Fingerprints hash the bytes, so equal fingerprints mean equal tensors whatever
rank or name they sit under. That turns "the output is garbage" into a sentence: worker 1
``experts.0.gate_up_proj`` holds trainer rank 1's ``experts.4.gate_up_proj``.

The match matrix has one row per (worker, name) with a status:
``match`` (the trainer's tensor of that name), ``mislabel`` (another exported tensor, named
in ``holds_rank`` / ``holds_name``), ``cast`` (the trainer's tensor of that name after a
lossy cast: the values sent, not the values trained), ``stale`` (no tensor any trainer rank
exported: left from before the sync).

Routing comes from the scenarios' ``routing:`` notes (per token, the expert set with the
trainer's bias and with the synced one); the output gap from the ``logprobs`` outputs.
Pure functions of a record's tables: a live session and a loaded bundle read alike.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pandas as pd

from workbench.analysis.findings import FINDING_COLUMNS

ROUTING_NOTE = "routing:"
WORKER_RE = re.compile(r"^worker(?P<w>\d+)\.(?P<hf>.*)$")
MATCH_COLUMNS = ["worker", "rank", "name", "status", "holds_rank", "holds_name", "dtype", "trainer_dtype", "sent_dtype",
                 "finding"]


def _record(source: Any) -> Any:
    """A RunRecord from a session (``.record()``) or a record as it is."""
    rec = source.record() if hasattr(source, "record") and callable(source.record) else source
    return rec


def _at(df: pd.DataFrame, step: str | None) -> pd.DataFrame:
    if "step" not in df or df.empty:
        return df
    if step is None:
        step = df["step"].iloc[-1]
    return df[df["step"] == step]


def _short(name: str) -> str:
    return name.replace("model.layers.", "L").replace(".mlp.", ".")


def workers(source: Any) -> dict[int, int]:
    """Engine rank -> the inference worker it hosts (from the probed ``worker<w>.`` names)."""
    t = _record(source).tensors
    hit = t["name"].str.extract(WORKER_RE) if len(t) else pd.DataFrame(columns=["w"])
    return {int(r): int(w) for r, w in zip(t["rank"][hit["w"].notna()], hit["w"].dropna())}


def _split(t: pd.DataFrame, prefix: str) -> pd.DataFrame:
    part = t[t["name"].str.startswith(prefix)].copy()
    part["hf"] = part["name"].str[len(prefix):]
    return part


def match_matrix(source: Any, step: str | None = None) -> pd.DataFrame:
    """Per worker and name it holds: whose tensor is it (see the module doc for the statuses)."""
    rec = _record(source)
    t = _at(rec.tensors, step)
    trainer, sent = _split(t, "trainer."), _split(t, "sent.")
    hit = t["name"].str.extract(WORKER_RE)
    loaded = t[hit["w"].notna()].assign(worker=hit["w"].dropna().astype(int), hf=hit["hf"].dropna())
    by_fp: dict[Any, list[tuple[int, str]]] = {}
    for r in trainer.itertuples():
        by_fp.setdefault(r.fingerprint, []).append((int(r.rank), r.hf))
    own = {(int(r.rank), r.hf): r for r in trainer.itertuples()}
    any_owner = {r.hf: r for r in trainer.itertuples()}
    sent_of = {(int(r.rank), r.hf): r for r in sent.itertuples()}
    rows = []
    for r in loaded.itertuples():
        rank, w = int(r.rank), int(r.worker)
        truth = own.get((w, r.hf)) or any_owner.get(r.hf)
        row = {"worker": w, "rank": rank, "name": r.hf, "status": "stale", "holds_rank": None, "holds_name": None,
               "dtype": r.dtype, "trainer_dtype": None if truth is None else truth.dtype, "sent_dtype": None}
        if truth is not None and truth.fingerprint == r.fingerprint:
            row.update(status="match", holds_rank=int(truth.rank), holds_name=r.hf)
        elif r.fingerprint in by_fp:
            hits = by_fp[r.fingerprint]
            hr, hn = next(((a, b) for a, b in hits if a == w), hits[0])
            row.update(status="mislabel" if hn != r.hf else "match", holds_rank=hr, holds_name=hn)
        else:
            s = sent_of.get((w, r.hf)) or next((v for (a, b), v in sent_of.items() if b == r.hf), None)
            if s is not None and truth is not None and s.dtype != truth.dtype and _same_values(s, r):
                row.update(status="cast", holds_rank=int(s.rank), holds_name=r.hf, sent_dtype=s.dtype)
        row["finding"] = _sentence(row)
        rows.append(row)
    return pd.DataFrame(rows, columns=MATCH_COLUMNS)


def sliced_with(source: Any, step: str | None = None) -> dict[str, Any] | None:
    """The rank whose metadata the mislabeled workers sliced their own buffers with, when one explains
    them all: every wrong name a worker loaded is that rank's export, and its bytes are the worker's own
    trainer rank's (seed 002: one request carried rank 0's names and offsets to every worker)."""
    m = match_matrix(source, step)
    bad = m[m["status"] == "mislabel"]
    if not len(bad) or bad["holds_rank"].isna().any() or not (bad["holds_rank"].astype(int) == bad["worker"]).all():
        return None
    trainer = _split(_at(_record(source).tensors, step), "trainer.")
    exported = {int(r): set(g["hf"]) for r, g in trainer.groupby("rank")}
    workers = sorted(int(w) for w in set(bad["worker"]))
    for src in sorted(exported):
        if src not in workers and all(set(bad[bad["worker"] == w]["name"]) <= exported[src] for w in workers):
            return {"rank": src, "workers": workers}
    return None


def _same_values(a: Any, b: Any) -> bool:
    ha, hb = list(a.head) if a.head is not None else [], list(b.head) if b.head is not None else []
    return bool(ha) and ha == hb and a.numel == b.numel


def _sentence(row: dict[str, Any]) -> str:
    w, n = row["worker"], row["name"]
    if row["status"] == "match":
        return f"worker {w} `{n}` holds the trainer's `{n}`"
    if row["status"] == "mislabel":
        return f"worker {w} `{n}` holds trainer rank {row['holds_rank']}'s `{row['holds_name']}`"
    if row["status"] == "cast":
        return (f"worker {w} `{n}` holds the trainer's `{n}` rounded to {row['sent_dtype']}"
                f" ({row['trainer_dtype']} on the trainer)")
    return f"worker {w} `{n}` holds no tensor any trainer rank exported (stale since before the sync)"


def mislabels(source: Any, step: str | None = None) -> list[str]:
    """The sentences for every name that does not hold the trainer's tensor of that name."""
    m = match_matrix(source, step)
    order = {"mislabel": 0, "cast": 1, "stale": 2}
    bad = m[m["status"] != "match"]
    return list(bad.iloc[sorted(range(len(bad)), key=lambda i: (order[bad["status"].iloc[i]], i))]["finding"])


def findings(source: Any, step: str | None = None) -> pd.DataFrame:
    """The match matrix as finding rows (``FINDING_COLUMNS``), one per worker and status."""
    m = match_matrix(source, step)
    rec = _record(source)
    st = step or (rec.tensors["step"].iloc[-1] if len(rec.tensors) else "")
    rows = []
    for (_w, status), g in m[m["status"] != "match"].groupby(["worker", "status"]):
        first = g.iloc[0]
        rows.append({"step": st, "severity": "error", "rank": int(first["rank"]), "name": first["name"],
                     "detector": "weight-sync match",
                     "finding": f"{len(g)} name(s) {status}: " + "; ".join(g["finding"].head(2))
                     + (" ..." if len(g) > 2 else "")})
    return pd.DataFrame(rows, columns=FINDING_COLUMNS)


# -- routing -----------------------------------------------------------------------------------
def _notes(rec: Any) -> list[str]:
    return [n["note"] if isinstance(n, dict) else str(n) for n in (rec.notes or [])]


def routing(source: Any) -> pd.DataFrame:
    """Per worker, router and token: expert set with the trainer's bias vs after the sync."""
    rows = []
    for note in _notes(_record(source)):
        if not note.startswith(ROUTING_NOTE):
            continue
        doc = json.loads(note[len(ROUTING_NOTE):])
        for i, (a, b) in enumerate(zip(doc["trainer"], doc["synced"])):
            rows.append({"worker": doc["worker"], "router": doc["router"], "token": i, "trainer": list(a),
                         "synced": list(b), "changed": list(a) != list(b)})
    return pd.DataFrame(rows, columns=["worker", "router", "token", "trainer", "synced", "changed"])


def router_biases(source: Any) -> pd.DataFrame:
    """Per worker and router: the bias per expert, trainer vs synced (from the routing notes)."""
    rows = []
    for note in _notes(_record(source)):
        if note.startswith(ROUTING_NOTE):
            doc = json.loads(note[len(ROUTING_NOTE):])
            for e, (a, b) in enumerate(zip(doc["bias_trainer"], doc["bias_synced"])):
                rows.append({"worker": doc["worker"], "router": doc["router"], "expert": e, "trainer": a, "synced": b})
    return pd.DataFrame(rows, columns=["worker", "router", "expert", "trainer", "synced"])


def routing_summary(source: Any) -> pd.DataFrame:
    """Per worker and router: fraction of tokens whose expert set changed, distinct bias values."""
    r = routing(source)
    b = router_biases(source)
    rows = []
    for (w, router), g in r.groupby(["worker", "router"]):
        bb = b[(b["worker"] == w) & (b["router"] == router)]
        rows.append({"worker": int(w), "router": router, "changed_fraction": float(g["changed"].mean()),
                     "distinct_bias_trainer": int(bb["trainer"].nunique()),
                     "distinct_bias_synced": int(bb["synced"].nunique())})
    return pd.DataFrame(rows, columns=["worker", "router", "changed_fraction", "distinct_bias_trainer",
                                       "distinct_bias_synced"])


# -- output gap --------------------------------------------------------------------------------
def output_gap(*sources: Any) -> pd.DataFrame:
    """Per run and worker: mean |log-prob - trainer's| before and after the sync, and the max after.

    ``presync``: the round trip before any sync (vLLM serving the trainer's own weights: kernels only;
    NaN for the stand-in, which computes like the trainer); ``receiver``: whose log-probs these are."""
    rows = []
    for src in sources:
        rec = _record(src)
        o = rec.outputs
        if o is None or o.empty:
            continue
        last = o[(o["name"] == "logprobs")]
        for r in last.itertuples():
            rows.append({"run": rec.label, "worker": int(r.worker), "rank": int(r.rank), "before": float(r.gap_before),
                         "after": float(r.gap_mean), "after_max": float(r.ref_max_abs_diff),
                         "presync": _num(getattr(r, "presync_gap", None)),
                         "receiver": _str(getattr(r, "receiver", None), "workbench")})
    return pd.DataFrame(rows, columns=["run", "worker", "rank", "before", "after", "after_max", "presync", "receiver"])


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _str(v: Any, default: str) -> str:
    return v if isinstance(v, str) and v else default


# -- buffer layout -----------------------------------------------------------------------------
def buffer_layout(source: Any, step: str | None = None) -> pd.DataFrame:
    """Per trainer rank and packed buffer (one per dtype): each tensor's offset and size, in packing order.

    Read from the ``sent.`` rows (probed in export order), plus ``loaded_as``: the name the
    worker reading that rank's buffer now holds those bytes under (from the match matrix;
    None where no worker name holds them).
    """
    rec = _record(source)
    t = _at(rec.tensors, step)
    sent = _split(t, "sent.")
    m = match_matrix(rec, step)
    held = {(int(r.worker), r.holds_name): r.name for r in m.itertuples() if r.status in ("match", "mislabel", "cast")}
    rows = []
    for (rank, dtype), g in sent.groupby(["rank", "dtype"], sort=False):
        off = 0
        for i, r in enumerate(g.itertuples()):
            rows.append({"rank": int(rank), "dtype": dtype, "index": i, "name": r.hf, "offset": off,
                         "size": int(r.numel), "loaded_as": held.get((int(rank), r.hf))})
            off += int(r.numel)
    return pd.DataFrame(rows, columns=["rank", "dtype", "index", "name", "offset", "size", "loaded_as"])
