"""The collectives ledger read back: its files line by line, and the rule by which two ranks' calls pair.

What the ledger writer (``ledger.py``) appends, read incrementally (``LedgerReader``: each poll parses only
the lines appended since the last; ``open_only`` keeps just the calls still inside, for a reader that
follows a long job), and ``mismatch_kind``: why two ranks' calls at the same position cannot pair.
Both the analysis (``analysis/collectives.py``, which re-exports them) and the job's post-mortem watcher
(which proves a deadlock from the ranks' open calls) read through this one module, so a scatter's root
(its whole list as payload) and a receiver pair the same way in both. Pure Python: no pandas, so a
training job that follows its own ledger does not import it.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any

OPEN = "started"
ROOTED = ("broadcast", "reduce", "scatter", "gather")




def _number(v: Any) -> bool:
    """A value a table cell really holds (not None, NaN or pandas' NA), without importing pandas."""
    if v is None or type(v).__name__ == "NAType":
        return False
    return not (isinstance(v, float) and math.isnan(v))


class LedgerReader:
    """Reads ledger files incrementally: each poll parses only the lines appended since the last.

    A session polls after every step (and while a step waits), so re-reading whole files
    would grow with the session; this keeps an offset per file and the merged calls.
    """

    def __init__(self, source: str | list[str], open_only: bool = False):
        self.source = source
        self.open_only = open_only  # forget a call once it ends (a watcher that follows a long job)
        self._offsets: dict[str, int] = {}
        self._calls: dict[tuple, dict[str, Any]] = {}

    def _paths(self) -> list[str]:
        src = self.source
        return sorted(glob.glob(os.path.join(src, "rank*.jsonl"))) if isinstance(src, str) else list(src)

    def poll(self) -> int:
        """Parse what was appended since the last poll; the number of new events."""
        n = 0
        for path in self._paths():
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                n += 1
                key = (ev.get("rank"), ev.get("session"), ev.get("attempt"), ev.get("group"), ev.get("seq"))
                if ev.get("ev") == "start":
                    self._calls[key] = {**ev, "t_start": ev.get("t"), "state": OPEN, "t_end": None, "error": None}
                elif ev.get("ev") == "end" and key in self._calls:
                    if self.open_only:
                        del self._calls[key]
                    else:
                        self._calls[key].update(state=ev["state"], error=ev.get("error"), t_end=ev.get("t"))
        return n

    def calls(self, **where: Any) -> list[dict[str, Any]]:
        """The merged calls read so far, those whose fields equal ``where`` (e.g. step=, attempt=)."""
        rows = self._calls.values()
        if where:
            rows = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
        return list(rows)


def mismatch_kind(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Why two ranks' calls at the same position cannot pair (op, dtype, size, root), or None.

    Where both rows say what travels between each pair (``send``/``recv``, see
    ``workbench.rank.traffic``), only that is compared: a broadcast's or scatter's source and a
    receiver pass different arguments by design. Rows without (Flight Recorder, older bundles)
    compare what each rank passed.
    """
    if a.get("op") != b.get("op") and {a.get("op"), b.get("op")} != {"send", "recv"}:  # a send pairs a recv
        return "op"
    flows = _flows(a, b)
    if flows is not None:
        if a.get("op") in ROOTED and _nz(a.get("src")) != _nz(b.get("src")):
            return "root"
        bad = [(x, y) for x, y in flows if x != y and "?" not in (x, y)]
        if not bad:
            return None
        x, y = bad[0]
        return "dtype" if _dtypes_of(x) != _dtypes_of(y) else "size"
    if (a.get("dtypes") or "") != (b.get("dtypes") or ""):
        return "dtype"
    if _nz(a.get("bytes")) != _nz(b.get("bytes")) or _nz(a.get("numel")) != _nz(b.get("numel")):
        return "size"
    if a.get("op") in ROOTED and _nz(a.get("src")) != _nz(b.get("src")):
        return "root"
    return None


def _traffic(c: dict[str, Any], key: str) -> dict[str, str] | None:
    v = c.get(key)
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return None
    return v if isinstance(v, dict) else None


def _index(c: dict[str, Any]) -> int | None:
    """The row's rank as an index into its group (the peers ``send``/``recv`` name)."""
    ranks = c.get("group_ranks")
    try:
        ranks = json.loads(ranks) if isinstance(ranks, str) else ranks
        return list(ranks).index(int(c["rank"])) if ranks is not None else int(c["rank"])
    except (TypeError, ValueError, KeyError):
        return None


def _flows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(what a sends b, what b receives from a) and back; None where a row does not say."""
    sa, ra, sb, rb = _traffic(a, "send"), _traffic(a, "recv"), _traffic(b, "send"), _traffic(b, "recv")
    ia, ib = _index(a), _index(b)
    if None in (sa, ra, sb, rb, ia, ib) or ia == ib:
        return None

    def to(d: dict[str, str], peer: int) -> str:
        return d.get(str(peer), d.get("*", "") if "*" in d else d.get("?", ""))

    return [(to(sa, ib), to(rb, ia)), (to(sb, ia), to(ra, ib))]


def _dtypes_of(flow: str) -> set[str]:
    return {part.split(":")[0] for part in flow.split(",") if part}


def _nz(v: Any) -> Any:
    return None if not _number(v) else int(v)
