"""Frames: what every rank held after one step, as pandas tables.

One vocabulary for notebooks, the CLI's JSON and bundles: the probe's column names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pandas as pd

from workbench.errors import RankFailure
from workbench.rank.columns import COLUMNS, TRACE_COLUMNS

EVENT_COLUMNS = ["rank", "kind", "error", "message", "traceback"]
# A backend's own words for a call whose peer went away (a released call's echo): gloo names its source file
_BACKEND_WORDS = re.compile(r"\[[^\]]*gloo[^\]]*\]|connection closed by peer|connection reset by peer"
                            r"|aborted by the workbench|\bnccl", re.I)
OUTPUT_COLUMNS = [*COLUMNS, "ref_max_abs_diff"]
INT_COLUMNS = ["rank", "numel", "nan", "inf", "poisoned"]
_INT_SET = frozenset(INT_COLUMNS)


_SOURCE_FILE = re.compile(r"\[[^\]]*\.(?:cc|cpp|cu|h)(?::\d+)?\]\s*")  # gloo's "[.../pair.cc:553] "
_TASK_DIED = re.compile(r"^Engine \d+ died while running task '[^']*'")  # ipyparallel's words, with its task id
_TASK_DIED_ANY = re.compile(r"Engine (\d+) died while running task '[^']*'")


# gloo's echo of a peer gone: "[<its source>.cc:553] Connection closed by peer [127.0.0.1]:2987. This is typically
# caused by a remote worker crashing. ..." (what, then where, then advice for gloo's own bug reports)
_ECHO = re.compile(r"\[[^\]]*\.(?:cc|cpp|cu|h)(?::\d+)?\]\s*(?:Read error \S+\s*)?(?P<what>[^\[.]*)"
                   r"(?:\s*\[[^\]]*\](?::\d+)?)?\.?(?:\s+This is typically caused[^)]*)?")
_ECHO_WORDS = {"connection closed by peer": "a peer closed the connection",
               "connection reset by peer": "a peer reset the connection"}


def plain_backend(text: Any) -> Any:
    """``text`` with a backend's echo of a peer gone (gloo's source file, address and bug-report advice) in a few
    words; other text, and anything not a string, as it is."""
    if not isinstance(text, str):
        return text
    text = _TASK_DIED_ANY.sub(lambda m: f"engine {m.group(1)} died while running a step", text)
    if not _SOURCE_FILE.search(text):
        return text

    def words(m: re.Match) -> str:
        what = m.group("what").strip().rstrip(":").strip()
        return f"gloo: {_ECHO_WORDS.get(what.lower(), what.lower() or 'the connection failed')}"

    return _ECHO.sub(words, text)


def is_backend_echo(kind: str, message: Any) -> bool:
    """Whether a failed call's message is the backend's own (a peer gone, a cut socket), not the rank's code."""
    return kind == "error" and bool(_BACKEND_WORDS.search(str(message or "").split("\n")[0]))


def released_words(call: str) -> str:
    return (f"aborted by the workbench: it released {call}, which could never complete (a deadlock proven from the "
            "ledgers)")


def worded_failure(kind: str, message: Any, released: str | None = None, aborted_before: bool = False) -> str:
    """A failed rank's message in the workbench's words, for a page a person reads: a call the workbench released
    says so; a backend's echo of a peer gone says that, after an earlier release that the group was aborted; an
    engine that died says it died. A rank's own exception keeps its first line. The raw text stays in the events."""
    text = str(message or "")
    first = text.split("\n")[0]
    if is_backend_echo(kind, text):
        if released:
            return released_words(released)
        if aborted_before:
            return ("its collective failed at once: the workbench aborted this process group earlier in the run, "
                    "releasing a proven deadlock")
        backend = "nccl" if "nccl" in first.lower() else "gloo"
        return f"its collective failed: a peer of the process group went away ({backend} lost the connection)"
    if kind == "died" and _TASK_DIED.match(first):
        return "the engine process died while running this step; call cluster.restart()"
    return _SOURCE_FILE.sub("", first)


def table(rows: list[dict[str, Any]], columns: list[str]) -> pd.DataFrame:
    """Rows as a DataFrame with ``columns`` first (missing ones empty), extra keys after."""
    seen = dict.fromkeys(columns)
    for r in rows:
        if r.keys() - seen.keys():
            seen.update(dict.fromkeys(r))
    order = list(seen)
    # Counts stay integers (meta rows get <NA>): built as Int64 arrays, the same frame as ``astype`` gives from the
    # object columns, at a third of its cost (a CLI run builds ~16 of these tables after its steps).
    return pd.DataFrame({c: pd.array([r.get(c) for r in rows], dtype="Int64") if c in _INT_SET
                         else [r.get(c) for r in rows] for c in order}, columns=order)


class Frame:
    """One step on every rank: tensors, outputs, per-rank failures, timings and notes.

    The per-tensor tables are built when first read, not when the step returns: a user
    stepping through a scenario looks at some frames, and a step should not wait for
    DataFrames nobody asked for.
    """

    def __init__(self, step: str, index: int, scenario: str, fix: str | None,
                 tensors: pd.DataFrame | list[dict[str, Any]], outputs: pd.DataFrame | list[dict[str, Any]],
                 events: pd.DataFrame | list[dict[str, Any]], elapsed: dict[int, float] | None = None,
                 notes: dict[int, list[str]] | None = None,
                 trace: pd.DataFrame | list[dict[str, Any]] | None = None,
                 ledger: pd.DataFrame | Callable[[], pd.DataFrame] | None = None, hang: Any = None):
        self.step, self.index, self.scenario, self.fix = step, index, scenario, fix
        self._tables: dict[str, Any] = {"tensors": tensors, "outputs": outputs, "events": events,
                                        "trace": [] if trace is None else trace}
        self.elapsed = elapsed or {}
        self.notes = notes or {}
        self.ledger = pd.DataFrame() if ledger is None else ledger
        self.hang = hang  # workbench.analysis.collectives.Hang when the step did not finish on every rank

    def _table(self, name: str, columns: list[str]) -> pd.DataFrame:
        v = self._tables[name]
        if not isinstance(v, pd.DataFrame):
            v = self._tables[name] = table(v, columns)
        return v

    @property
    def tensors(self) -> pd.DataFrame:
        return self._table("tensors", COLUMNS)

    @property
    def outputs(self) -> pd.DataFrame:
        return self._table("outputs", OUTPUT_COLUMNS)

    @property
    def events(self) -> pd.DataFrame:
        """One row per rank that failed this step: an exception, a missed deadline, a death."""
        return self._table("events", EVENT_COLUMNS)

    @property
    def ledger(self) -> pd.DataFrame:
        """The collectives this step issued, per rank (built when first read, like the tables)."""
        if callable(self._ledger):
            self._ledger = self._ledger()
        return self._ledger

    @ledger.setter
    def ledger(self, value: pd.DataFrame | Callable[[], pd.DataFrame]) -> None:
        self._ledger = value

    @property
    def kinds(self) -> set[str]:
        """The kinds of failure this step saw ('error', 'timeout', 'died', 'stopped'), without building a table."""
        v = self._tables["events"]
        return set(v["kind"]) if isinstance(v, pd.DataFrame) else {e["kind"] for e in v}

    def ranks_with(self, kind: str) -> set[int]:
        """The ranks with a ``kind`` event ('error', 'skipped', ...), without building a table."""
        v = self._tables["events"]
        if isinstance(v, pd.DataFrame):
            return {int(r) for r in v.loc[v["kind"] == kind, "rank"]} if len(v) else set()
        return {int(e["rank"]) for e in v if e["kind"] == kind}

    @property
    def trace(self) -> pd.DataFrame:
        """Forward-trace rows (one per module call) when the step traced a forward."""
        return self._table("trace", TRACE_COLUMNS)

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
        events.sort(key=lambda e: e["rank"])
        return cls(step, index, scenario, fix, tensors, outputs, events, elapsed, notes, trace)

    @property
    def rank_errors(self) -> dict[int, str]:
        """rank -> 'kind Error: message' for every rank that failed this step. A call the workbench released (a
        deadlock proven from the ledgers) reads in those words, not in the backend's: what gloo says when its
        socket is cut (``[../gloo/transport/tcp/pair.cc:553] Connection closed by peer``) is the release's echo,
        not a timeout or a crash (the raw message stays in ``events``)."""
        released = getattr(self, "released", None) or {}
        out = {}
        for r in self.events.itertuples():
            text = f"{r.kind} {r.error}: {r.message}"
            call = released.get(int(r.rank))
            if call and is_backend_echo(r.kind, r.message):
                text = f"{r.kind} {r.error}: {released_words(call)}"
            out[int(r.rank)] = text
        return out

    @property
    def ok(self) -> bool:
        return not self.kinds

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


def short(name: str) -> str:
    """Tensor names without the wrapper prefixes every row shares."""
    for prefix in ("model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def shorten(names: list[str]) -> dict[str, str]:
    """Full name -> label (a figure's axis, the CLI's summary): the dotted prefix every name shares is
    dropped (a figure keeps the full name in its hover text), so
    ``model.model.layers.0.mlp.up_proj.weight`` reads ``layers.0.mlp.up_proj.weight``."""
    parts = [str(n).split(".") for n in names]
    k = 0
    if len(parts) > 1:
        while all(len(p) > k + 1 for p in parts) and len({p[k] for p in parts}) == 1:
            k += 1
    else:
        return {n: short(n) for n in names}
    return {n: ".".join(p[k:]) for n, p in zip(names, parts)}


def stack(frames: list[Frame], attr: str) -> pd.DataFrame:
    """One table of ``attr`` (tensors, outputs, events, trace) over ``frames``, each row with its step and step
    index: a run's history, as a live session and a captured job's shards both build it."""
    parts = []
    for f in frames:
        df = getattr(f, attr).copy()
        df.insert(0, "step_index", f.index)
        df.insert(0, "step", f.step)
        parts.append(df)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
