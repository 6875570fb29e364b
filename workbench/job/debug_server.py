"""The capture's handler on PyTorch's debug server, and the client that asks it.

Where the job runs PyTorch's debug server (``torch.distributed.debug.start_debug_server``: a worker server per
rank), a handler of the capture's own (``workbench_capture``) answers a POST to
``<worker>/handler/workbench_capture`` with this rank's latest point and its open calls (``Snapshots.snapshot``),
or with ``?shard=1`` the rank's whole shard file by file (``Snapshots.files``), while the job runs or hangs. The
shard records the worker's address (``worker_url``); ``ask``, ``ask_all`` and ``fetch`` are the client side
(``workbench report URL,URL`` reads a running job through them).
"""

from __future__ import annotations

import json
import os
import sys
from http.client import HTTPException
from pathlib import Path
from typing import Any, Protocol

from workbench.job import process
from workbench.rank import shard_format

HANDLER = "workbench_capture"  # the debug server's handler name: POST <worker>/handler/workbench_capture


class Snapshots(Protocol):
    """What the handler asks of the open capture (``shard.Capture``)."""

    def snapshot(self) -> dict[str, Any]: ...

    def files(self) -> dict[str, Any]: ...


# The one process-wide fact here: c10d's handler registry is a C++ static of the process, registered once; the
# registered function answers for the capture open now (``process.STATE.capture``).
_REGISTERED: list[bool] = []


def register() -> None:
    """Register the handler with c10d's handler registry, once per process; it answers for the open capture.

    The registry is a C++ static: it drops its Python callables at exit without the GIL, which aborts
    the interpreter (rc 134) when that drops the last reference. One reference more than the registry
    holds keeps the function alive past that point (measured: without it, a plain script that registers
    a handler exits with SIGABRT)."""
    if _REGISTERED:
        return
    _REGISTERED.append(True)
    try:
        import ctypes

        from torch._C._distributed_c10d import _register_handler as register_handler
    except ImportError:  # a torch without the debug server
        return
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_handle))
    try:
        register_handler(HANDLER, _handle)
    except ValueError:  # registered already (this module imported twice under two names)
        pass


def _handle(req: Any, resp: Any) -> None:
    """The debug server's call (on its own thread): the open capture's snapshot as JSON."""
    try:
        cap: Snapshots | None = process.STATE.capture
        try:
            whole = req.get_param("shard") in ("1", "true")
        except Exception:  # no such parameter (the request type is torch's, its errors unspecified)
            whole = False
        body = ({"error": "no open capture in this process"} if cap is None
                else cap.files() if whole else cap.snapshot())
        resp.set_content(json.dumps(body, default=shard_format.plain).encode(), "application/json")
        resp.set_status(200 if cap is not None else 404)
    except Exception as exc:  # the boundary of the handler, in the job's process: a 500 with the cause
        resp.set_content(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode(), "application/json")
        resp.set_status(500)


def worker_url() -> str | None:
    """Where this rank's debug-server worker answers, where the job runs PyTorch's debug server (else None)."""
    server = getattr(sys.modules.get("torch.distributed.debug"), "_WORKER_SERVER", None)
    return None if server is None else f"http://{shard_format.host()}:{server.port}"


def ask(url: str, timeout: float = 10.0, shard: bool = False) -> dict[str, Any]:
    """A running (or hung) rank's snapshot through its debug-server worker (``shard.json``'s
    ``debug_server``, or the frontend's ``rank<r>`` address): latest point and open calls; with
    ``shard=True`` the rank's whole shard, file by file."""
    import urllib.request

    query = "?shard=1" if shard else ""
    req = urllib.request.Request(f"{url.rstrip('/')}/handler/{HANDLER}{query}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def ask_all(path: str | os.PathLike, timeout: float = 10.0) -> dict[int, dict[str, Any]]:
    """Every rank of a capture directory whose shard names a debug server, asked now: rank -> snapshot
    (or ``{"error": ...}`` for a rank that does not answer)."""
    out: dict[int, dict[str, Any]] = {}
    for d in sorted(Path(path).glob("rank*")):
        try:
            doc = json.loads((d / shard_format.MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if doc.get("debug_server"):
            try:
                out[int(doc["rank"])] = ask(doc["debug_server"], timeout)
            except (OSError, ValueError, HTTPException) as exc:  # down, refused, timed out, not JSON
                out[int(doc["rank"])] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def fetch(urls: list[str], out: str | os.PathLike, timeout: float = 30.0) -> tuple[Path, list[str]]:
    """Every rank's shard through its debug-server worker, written under ``out`` as a directory of shards
    (a job whose shards sit on node-local disks, read while it runs or hangs). Returns the directory and a
    line per worker that did not answer."""
    out = Path(out)
    missed: list[str] = []
    for url in urls:
        try:
            got = ask(url, timeout, shard=True)
            rank = int(got["rank"])
        except (OSError, ValueError, KeyError, TypeError, HTTPException) as exc:  # down, timed out, not a shard
            missed.append(f"{url}: {' '.join(f'{type(exc).__name__}: {exc}'.split())[:200]}")
            continue
        d = shard_format.rank_dir(out, rank)
        d.mkdir(parents=True, exist_ok=True)
        for name, text in got.get("files", {}).items():
            if name in (shard_format.MANIFEST, shard_format.POINTS, shard_format.STACKS, f"rank{rank}.jsonl"):
                (d / name).write_text(text)
    return out, missed
