"""Where every rank is while a step runs, in one line: who is done, who waits in which collective.

A step that takes long is either working or stuck, and from the client the two look the
same until a deadline fires. The ranks' ledgers say more while the step still runs: a rank
whose earliest open call started seconds ago is waiting in that collective for a peer. This
module turns the ledger rows read so far into the line a notebook or a terminal shows, e.g.
``rank 0 done 0.4 s · rank 1 in broadcast #1 bf16 833.9 KiB for 7.2 s``. Pure: the callers
read the ledger and the clock, so hand-made rows test it. It takes the ledger table or the
reader's raw rows alike; the live line passes raw open rows, because building a table of a
long step's every call several times a second would cost the ranks CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from workbench.analysis.collectives import OPEN, human_bytes, is_number

SEP = " · "
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}

Rows = pd.DataFrame | Iterable[Mapping[str, Any]] | None


def short_dtypes(dtypes: Any) -> str:
    """``bfloat16,float32`` (or the raw list) -> ``bf16,fp32``; what the ledger could not name stays out."""
    if isinstance(dtypes, (list, tuple)):
        dtypes = ",".join(str(d) for d in dtypes)
    if not isinstance(dtypes, str) or not dtypes:
        return ""
    return ",".join(SHORT_DTYPES.get(d, d) for d in dtypes.split(","))


def open_calls(ledger: Rows) -> list[dict[str, Any]]:
    """The calls still open (a rank is inside them), from a ledger table or raw rows."""
    if ledger is None:
        return []
    if isinstance(ledger, pd.DataFrame):
        return [] if ledger.empty else ledger[ledger["state"] == OPEN].to_dict("records")
    return [dict(c) for c in ledger if c.get("state") == OPEN]


def waiting_call(calls: list[dict[str, Any]], rank: int) -> dict[str, Any] | None:
    """The rank's earliest open call: where it waits (NCCL may queue more calls behind it)."""
    mine = [c for c in calls if is_number(c.get("rank")) and int(c["rank"]) == rank and is_number(c.get("t_start"))]
    return min(mine, key=lambda c: (float(c["t_start"]), int(c["seq"]) if is_number(c.get("seq")) else 0), default=None)


def call_words(call: Mapping[str, Any]) -> str:
    """``broadcast #1 bf16 833.9 KiB`` (and ``on group 1`` off the default group)."""
    parts = [str(call.get("op")), f"#{call['seq']}" if is_number(call.get("seq")) else "",
             short_dtypes(call.get("dtypes")), human_bytes(call.get("bytes"))]
    group = call.get("group")
    if group is not None and str(group) not in ("0", ""):
        parts.append(f"on group {group}")
    return " ".join(p for p in parts if p)


def _seconds(s: float) -> str:
    return f"{max(s, 0.0):.1f} s"


def rank_status(rank: int, calls: list[dict[str, Any]], done: Mapping[int, float], now: float,
                started: float) -> str:
    """One rank's part of the line: done (and after how long), waiting in a collective, or running.

    ``calls``: the open calls (``open_calls``)."""
    if rank in done:
        return f"rank {rank} done {_seconds(done[rank])}"
    call = waiting_call(calls, rank)
    if call is not None:
        return f"rank {rank} in {call_words(call)} for {_seconds(now - float(call['t_start']))}"
    return f"rank {rank} running {_seconds(now - started)}"


def status_line(ledger: Rows, ranks: Iterable[int], done: Mapping[int, float], now: float, started: float) -> str:
    """The whole step in one line, rank by rank.

    ``ledger``: this step's calls read so far (one attempt), as a ``ledger_table`` or the
    reader's raw rows (only the open ones matter); ``ranks``: every rank running the step;
    ``done``: rank -> seconds its step took, for the ranks that returned; ``now`` and
    ``started`` (the step's start): wall-clock seconds, the clock the ranks stamp their
    ledger rows with.
    """
    calls = open_calls(ledger)
    return SEP.join(rank_status(r, calls, done, now, started) for r in sorted(ranks))
