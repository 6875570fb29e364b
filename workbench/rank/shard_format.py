"""The shard format: what a rank of a captured job writes and the reader opens, in one place both import.

One folder per rank, each written by its own rank only::

    <dir>/rank<r>/shard.json      the manifest: job id, rank, world size, launcher, versions, the points so far
    <dir>/rank<r>/points.jsonl    one line per point (probe rows, outputs, trace, notes) and per exception
    <dir>/rank<r>/rank<r>.jsonl   the collectives ledger (``rank/ledger.py``)
    <dir>/rank<r>/stacks.txt      Python stacks, where faulthandler wrote them (SIGUSR1)

Why here, on the rank floor: the writer (``job/shard.py``, inside the user's training process) and the reader
(``postmortem/shards.py``) must agree on every name, and the writer must not import the reader (pandas, the
analysis layer). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

FORMAT = "workbench-shard"
SCHEMA = 1
MANIFEST = "shard.json"
POINTS = "points.jsonl"
STACKS = "stacks.txt"


def rank_dir(root: str | os.PathLike, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def ledger_file(root: str | os.PathLike, rank: int) -> Path:
    """The ledger's own name (``rank.ledger.ledger_path``) inside the rank's folder."""
    return rank_dir(root, rank) / f"rank{rank}.jsonl"


def host() -> str:
    return socket.gethostname()


def plain(v: Any) -> Any:
    """A value a shard's JSON cannot hold as it is (``json.dumps``'s ``default``): a tensor's or array's list,
    anything else its ``str``."""
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


def write_json_atomic(path: Path, doc: dict[str, Any], indent: int | None = None) -> None:
    """Write a small JSON file by rename: a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, default=str, indent=indent)
        os.replace(tmp, path)
    except BaseException:  # a full disk: the file before stays whole, and no half-written copy beside it
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def gone(doc: dict[str, Any]) -> bool:
    """A shard with no close (still "running") whose process is gone: killed or crashed. Known only for a rank of
    this host (its pid no longer runs, or runs another program started since); a rank elsewhere is not named."""
    if doc.get("status") != "running" or doc.get("host") != host() or not isinstance(doc.get("pid"), int):
        return False
    try:
        import psutil

        proc = psutil.Process(doc["pid"])  # a zombie is dead too (its launcher has not reaped it yet)
        return proc.status() == psutil.STATUS_ZOMBIE or proc.create_time() > float(doc.get("started_at") or 0) + 1.0
    except ImportError:
        try:
            with open(f"/proc/{doc['pid']}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True
    except Exception:  # psutil.NoSuchProcess, or a process we may not read: judged by /proc
        return not os.path.exists(f"/proc/{doc['pid']}")


def last_point(d: Path) -> str | None:
    """The name of the last point whose line is whole in ``d``'s points file, read from its end (a line per point:
    the manifest's list may be up to ``job/capture_points.MANIFEST_EVERY_S`` behind it); None where it holds
    none or cannot be read."""
    try:
        with open(d / POINTS, "rb") as f:
            pos = f.seek(0, os.SEEK_END)
            head = b""
            while pos > 0:
                step = min(1 << 20, pos)
                pos -= step
                f.seek(pos)
                lines = (f.read(step) + head).split(b"\n")
                head = lines.pop(0) if pos > 0 else b""  # maybe the tail of a line that starts further back
                for raw in reversed(lines):
                    with contextlib.suppress(ValueError):  # a line cut short by the kill: the one before it
                        rec = json.loads(raw)
                        if isinstance(rec, dict) and rec.get("kind") == "point":
                            return str(rec.get("point"))
    except OSError:
        return None
    return None


def dead_line(rank: int, after: str | None) -> str:
    """``rank 1 stopped after point `step1` (its shard ends without a close: killed or crashed)``."""
    where = f"after point `{after}`" if after else "before its first point"
    return f"rank {rank} stopped {where} (its shard ends without a close: killed or crashed)"
