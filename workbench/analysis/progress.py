"""Where every rank is while a step runs, in one line: who is done, who waits in which collective.

A step that takes long is either working or stuck, and from the client the two look the
same until a deadline fires. The ranks' ledgers say more while the step still runs: a rank
whose earliest open call started seconds ago is waiting in that collective for a peer. This
module turns the ledger rows read so far into the line a notebook or a terminal shows, e.g.
``rank 0 done 0.4 s · rank 1 in broadcast #1 bf16 833.9 KiB for 7.2 s``. Pure: the callers
read the ledger and the clock, so hand-made rows test it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from workbench.analysis.collectives import OPEN, _num, _size

SEP = " · "
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def short_dtypes(dtypes: Any) -> str:
    """``bfloat16,float32`` -> ``bf16,fp32``; what the ledger could not name stays out."""
    if not isinstance(dtypes, str) or not dtypes:
        return ""
    return ",".join(SHORT_DTYPES.get(d, d) for d in dtypes.split(","))


def waiting_call(ledger: pd.DataFrame | None, rank: int) -> dict[str, Any] | None:
    """The rank's earliest open call: where it waits (NCCL may queue more calls behind it)."""
    if ledger is None or ledger.empty:
        return None
    mine = ledger[(ledger["rank"] == rank) & (ledger["state"] == OPEN)]
    if mine.empty:
        return None
    return dict(mine.sort_values(["t_start", "seq"]).iloc[0])


def call_words(call: Mapping[str, Any]) -> str:
    """``broadcast #1 bf16 833.9 KiB`` (and ``on group 1`` off the default group)."""
    parts = [str(call.get("op")), f"#{call['seq']}" if _num(call.get("seq")) else "",
             short_dtypes(call.get("dtypes")), _size(call.get("bytes"))]
    group = call.get("group")
    if group is not None and str(group) not in ("0", ""):
        parts.append(f"on group {group}")
    return " ".join(p for p in parts if p)


def _seconds(s: float) -> str:
    return f"{max(s, 0.0):.1f} s"


def rank_status(rank: int, ledger: pd.DataFrame | None, done: Mapping[int, float], now: float,
                started: float) -> str:
    """One rank's part of the line: done (and after how long), waiting in a collective, or running."""
    if rank in done:
        return f"rank {rank} done {_seconds(done[rank])}"
    call = waiting_call(ledger, rank)
    if call is not None and _num(call.get("t_start")):
        return f"rank {rank} in {call_words(call)} for {_seconds(now - float(call['t_start']))}"
    return f"rank {rank} running {_seconds(now - started)}"


def status_line(ledger: pd.DataFrame | None, ranks: Iterable[int], done: Mapping[int, float], now: float,
                started: float) -> str:
    """The whole step in one line, rank by rank.

    ``ledger``: this step's calls read so far (one attempt; ``ledger_table`` rows);
    ``ranks``: every rank running the step; ``done``: rank -> seconds its step took, for
    the ranks that returned; ``now`` and ``started`` (the step's start): wall-clock seconds,
    the clock the ranks stamp their ledger rows with.
    """
    return SEP.join(rank_status(r, ledger, done, now, started) for r in sorted(ranks))
