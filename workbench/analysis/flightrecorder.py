"""Flight Recorder interop: a session's ledger as Flight Recorder dumps, and dumps as ledger rows.

PyTorch's Flight Recorder keeps a ring buffer of each rank's collectives and writes it as
one file per rank (a pickle when ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` dumps on a timeout or
``torch._C._distributed_c10d._dump_fr_trace()`` is called, JSON from
``_dump_fr_trace_json()``). Converting both ways lets a production hang be read with the
workbench's first-divergence diagnosis and swimlane without re-running it, and lets a
workbench session be handed to PyTorch's own analyser (``torchfrtrace DIR``).

Pure functions on dicts and tables (``rows_from_flight_recorder`` gives plain ledger rows;
``wb.collectives.from_flight_recorder`` turns them into the ledger table). What the two
records disagree on, measured on torch 2.13 (gloo) and 2.11 (NCCL):

- gloo dumps name the default group ``""`` in ``pg_config`` while entries say
  ``('0', 'default_pg')`` (PyTorch's analyser then fails with ``KeyError: ('0', 1)``);
  groups are read from the entries here, and the export writes a consistent ``pg_config``.
- gloo entries stay ``scheduled`` with no timing; whether a call finished comes from
  ``retired`` and the dump's ``pg_status`` (last completed sequence number per group).
  A gloo call that failed (its peer left) is retired and counted as completed all the
  same: the dump cannot tell it from a finished one.
- Flight Recorder numbers collectives and point-to-point calls separately
  (``collective_seq_id``, ``p2p_seq_id``) and does not record a broadcast's root; gloo does
  not record send/recv at all. Imported p2p calls go to one group per pair of ranks
  (``<pg>:p2p 0-1``), numbered in issue order, so rank 0's n-th send to rank 1 lines up
  with rank 1's n-th receive from rank 0.
- A ring buffer that wrapped starts later on some ranks: each group keeps only the
  sequence numbers every rank still holds, so the first divergence is not an artefact.
- A coalesced group (several entries sharing one ``collective_seq_id``, closed by a
  ``coalesced`` marker) becomes one row per member with ``via="coalesced"`` and its index
  in ``bucket``; the marker itself is dropped.
- The ledger keeps what Flight Recorder has no field for (step, session, bucket, root,
  failed/timed-out state, error) in an extra ``workbench`` key of each exported entry;
  PyTorch's analyser ignores it and the import restores it.

Pickle is read with an unpickler that allows no classes: a Flight Recorder dump holds only
dicts, lists, tuples, strings and numbers, so a foreign pickle is refused, not executed.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.errors import WorkbenchError

FR_VERSION = "2.10"  # what torch 2.13's writer puts in "version" (its analyser needs "MAJOR.MINOR")
DEFAULT_PREFIX = "nccl_trace_rank_"  # torch's default TORCH_NCCL_DEBUG_INFO_TEMP_FILE name

# ledger op name -> the name Flight Recorder's writers use after "<backend>:" (NCCL's profiling titles)
FR_NAMES = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "allreduce_coalesced", "broadcast": "broadcast",
    "all_gather_into_tensor": "_all_gather_base", "all_gather": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "all_gather_coalesced": "ALLGATHER_coalesced", "reduce_scatter_tensor": "_reduce_scatter_base",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce": "reduce", "gather": "gather", "scatter": "scatter", "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all_single", "barrier": "barrier", "monitored_barrier": "barrier",
    "send": "send", "recv": "recv", "recv_any_source": "recv",
}
# Flight Recorder name -> ledger op name (several writers' spellings of one collective)
LEDGER_OPS = {
    **{v: k for k, v in FR_NAMES.items() if k not in ("monitored_barrier", "recv_any_source")},
    "_broadcast_oop": "broadcast", "_reduce_oop": "reduce", "all_gather_single": "all_gather_into_tensor",
    "all_gather_base": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
    "REDUCE_SCATTER_coalesced": "reduce_scatter_tensor_coalesced", "all_reduce_barrier": "barrier",
    "all_to_all_v_single": "all_to_all_single", "all_gather_v": "all_gather", "reduce_scatter_v": "reduce_scatter",
}
P2P = ("send", "recv")
# torch dtype name -> c10 ScalarType name (what Flight Recorder writes), and element sizes
FR_DTYPES = {
    "float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
    "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool",
    "complex64": "ComplexFloat", "complex128": "ComplexDouble", "complex32": "ComplexHalf",
    "float8_e4m3fn": "Float8_e4m3fn", "float8_e5m2": "Float8_e5m2", "float8_e4m3fnuz": "Float8_e4m3fnuz",
    "float8_e5m2fnuz": "Float8_e5m2fnuz", "uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64",
}
TORCH_DTYPES = {v: k for k, v in FR_DTYPES.items()}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "complex32": 4,
            "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
            "uint16": 2, "uint32": 4, "uint64": 8}
# ledger states -> Flight Recorder's three (a failed or timed-out call never completed on the wire)
FR_STATES = {"completed": "completed", "started": "started", "issued": "scheduled", "failed": "started",
             "timed out": "started"}
EXTRAS = ("session", "attempt", "step", "via", "bucket", "bucket_tensors", "src", "dst", "state", "error",
          "caller", "user_frame")
_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?P<ext>\.(?:json|pkl|pickle))?$")
_PLUMBING = (os.sep + os.path.join("torch", "distributed") + os.sep, os.sep + os.path.join("torch", "nn") + os.sep)


class FlightRecorderError(WorkbenchError):
    """Flight Recorder dumps that cannot be read: a missing directory, no dumps, a corrupt or foreign file."""


# -- export ------------------------------------------------------------------------------
def to_flight_recorder(ledger: pd.DataFrame, out_dir: str | os.PathLike, prefix: str = DEFAULT_PREFIX,
                       backend: str | None = None) -> list[Path]:
    """Write a ledger table as one Flight Recorder dump per rank (pickle, as torch writes it).

    ``torchfrtrace OUT_DIR -p PREFIX`` reads the result. Every rank of every group gets a
    file, an empty one when it issued nothing (PyTorch's analyser refuses a job with a
    missing rank). Several attempts of one session: the latest is written (sequence
    numbers restart per attempt). ``backend`` ("gloo", "nccl") prefixes the op names;
    default: the one an imported table carries, else gloo.
    """
    if ledger is None or not len(ledger):
        raise FlightRecorderError("the ledger is empty: nothing to export")
    df = ledger
    if df["session"].nunique() > 1:
        raise FlightRecorderError(f"the ledger holds {df['session'].nunique()} sessions; export one "
                                  "(ledger[ledger.session == ...])")
    if df["attempt"].nunique() > 1:
        df = df[df["attempt"] == df["attempt"].max()]
    backend = backend or _backend_of(df)
    groups = _groups(df)
    ranks = sorted({int(r) for r in df["rank"]} | {r for members in groups.values() for r in members})
    pg_ids = {g: i for i, g in enumerate(groups)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for rank in ranks:
        part = df[df["rank"] == rank]
        entries = _entries(part, backend, pg_ids, groups)
        dump = {
            "version": FR_VERSION,
            "pg_config": {g: {"name": g, "desc": _desc(g), "ranks": str(members)} for g, members in groups.items()
                          if rank in members},
            "pg_status": _pg_status(entries, pg_ids),
            "comm_lib_version": "",
            "entries": entries,
        }
        path = out / f"{prefix}{rank}"
        path.write_bytes(pickle.dumps(dump))
        written.append(path)
    return written


def _backend_of(df: pd.DataFrame) -> str:
    for v in df["c10d_op"].dropna():
        if isinstance(v, str) and ":" in v and "::" not in v:
            return v.split(":", 1)[0]
    return "gloo"


def _groups(df: pd.DataFrame) -> dict[str, list[int]]:
    """Each group's member ranks: the ledger's ``group_ranks`` where recorded, else the ranks seen on it."""
    out: dict[str, set[int]] = {}
    for g, part in df.groupby("group", sort=True):
        members = {int(r) for r in part["rank"]}
        for v in part["group_ranks"].dropna().unique():
            try:
                members |= {int(r) for r in json.loads(v)}
            except (TypeError, ValueError):
                pass
        out[str(g)] = members
    return {g: sorted(m) for g, m in out.items()}


def _desc(group: str) -> str:
    return "default_pg" if group in ("0", "default_pg") else "undefined"


def _entries(part: pd.DataFrame, backend: str, pg_ids: dict[str, int],
             groups: dict[str, list[int]]) -> list[dict[str, Any]]:
    rows = part.sort_values(["t_start", "group", "seq"], na_position="last", kind="stable")
    coll: dict[str, int] = {}
    p2p: dict[str, int] = {}
    entries = []
    for record_id, (_, row) in enumerate(rows.iterrows()):
        r = row.to_dict()
        group, op = str(r["group"]), str(r["op"])
        name = FR_NAMES.get(op, op)
        is_p2p = name in P2P
        if is_p2p:
            p2p[group] = p2p.get(group, 0) + 1
        else:
            coll[group] = coll.get(group, 0) + 1
        members = groups[group]
        local = members.index(int(r["rank"])) if int(r["rank"]) in members else int(r["rank"])
        # Flight Recorder names a peer by its group rank: the ledger's ``group_dst``/``group_src`` (older rows
        # hold only ``dst``/``src``, which then were the group rank)
        if name == "send":
            name = f"send {local}->{_int(_peer(r, 'dst'), -1)}"
        elif name == "recv":
            name = f"recv {local}<-{_int(_peer(r, 'src'), -1)}"
        shapes = _shapes(r.get("shapes"))
        dtypes = [FR_DTYPES.get(d, d) for d in str(r.get("dtypes") or "").split(",") if d]
        in_dtypes = dtypes * len(shapes) if len(dtypes) == 1 else dtypes
        out_sizes = _output_sizes(op, shapes, len(members))
        state = FR_STATES.get(str(r.get("state")), "started")
        t0, t1 = _ns(r.get("t_start")), _ns(r.get("t_end"))
        entries.append({
            "record_id": record_id, "pg_id": pg_ids[group], "process_group": (group, _desc(group)),
            "collective_seq_id": coll.get(group, 0), "p2p_seq_id": p2p.get(group, 0), "op_id": _int(r.get("seq"), 0),
            "profiling_name": f"{backend}:{name}", "time_created_ns": t0 or 0,
            "input_sizes": shapes, "input_dtypes": in_dtypes,
            "output_sizes": out_sizes, "output_dtypes": [in_dtypes[0]] * len(out_sizes) if in_dtypes else [],
            "state": state, "time_discovered_started_ns": t0 if state != "scheduled" else None,
            "time_discovered_completed_ns": t1 if state == "completed" else None,
            "retired": state == "completed", "timeout_ms": 0, "is_p2p": is_p2p,
            "thread_name": "workbench-step", "thread_id": "0", "frames": _frames_out(r),
            "workbench": {k: _plain(r.get(k)) for k in EXTRAS},
        })
    return entries


def _pg_status(entries: list[dict[str, Any]], pg_ids: dict[str, int]) -> dict[str, dict[str, int]]:
    status: dict[str, dict[str, int]] = {}
    for e in entries:
        if e["is_p2p"]:
            continue
        s = status.setdefault(str(e["pg_id"]), {"last_enqueued_collective": -1, "last_started_collective": -1,
                                                "last_completed_collective": -1})
        seq = e["collective_seq_id"]
        s["last_enqueued_collective"] = max(s["last_enqueued_collective"], seq)
        if e["state"] in ("started", "completed"):
            s["last_started_collective"] = max(s["last_started_collective"], seq)
        if e["state"] == "completed":
            s["last_completed_collective"] = max(s["last_completed_collective"], seq)
    return status


def _shapes(v: Any) -> list[list[int]]:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return []
    if not isinstance(v, list):
        return []
    if v and all(isinstance(x, int) for x in v):
        return [list(v)]  # one tensor written flat
    return [[int(d) for d in s] for s in v if isinstance(s, list)]


def _output_sizes(op: str, shapes: list[list[int]], world: int) -> list[list[int]]:
    """What the collective writes, derived from its input the way the backends do (the ledger keeps inputs)."""
    if not shapes:
        return []
    first = shapes[0]
    if op == "all_gather_into_tensor":
        return [[first[0] * world, *first[1:]] if first else [world]]
    if op in ("all_gather", "all_gather_coalesced"):
        return [list(first) for _ in range(world)]
    if op == "reduce_scatter_tensor":
        return [[first[0] // world, *first[1:]] if first else []]
    if op == "reduce_scatter":
        return [list(first)]  # the ledger keeps every rank's input chunk; each is one output's shape
    return [list(s) for s in shapes]


def _frames_out(r: dict[str, Any]) -> list[dict[str, Any]]:
    frames = []
    for where in dict.fromkeys(w for w in (r.get("caller"), r.get("user_frame")) if isinstance(w, str) and w):
        loc, _, func = where.partition(" ")
        filename, _, line = loc.rpartition(":")
        frames.append({"name": func, "filename": filename or loc, "line": _int(line, 0)})
    return frames


def _ns(t: Any) -> int | None:
    try:
        t = float(t)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(t) else int(t * 1e9)


def _int(v: Any, default: int) -> int:
    try:
        if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
            return default
        return int(v)
    except (TypeError, ValueError):
        return default


def _plain(v: Any) -> Any:
    """A cell as a plain pickle-able value (no pandas NA, no numpy scalars)."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return None
    if hasattr(v, "item"):
        return v.item()
    return v


# -- import ------------------------------------------------------------------------------
def dump_files(path: str | os.PathLike, prefix: str | None = None) -> dict[int, Path]:
    """rank -> dump file: one file, or every ``<prefix><rank>[.json|.pkl]`` under a directory."""
    p = Path(path)
    if not p.exists():
        raise FlightRecorderError(f"{p}: no such file or directory")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    found: dict[str, dict[int, Path]] = {}
    for f in files:
        m = _NAME.match(f.name)
        if m and (prefix is None or m.group("prefix") == prefix):
            seen = found.setdefault(m.group("prefix"), {})
            rank = int(m.group("rank"))
            if rank in seen:
                raise FlightRecorderError(f"{p}: two dumps of rank {rank} ({seen[rank]}, {f}); "
                                          "point at the directory of one job and format")
            seen[rank] = f
    if not found:
        want = f"named {prefix}<rank>" if prefix is not None else "named <prefix><rank> (e.g. nccl_trace_rank_0)"
        raise FlightRecorderError(f"{p}: no Flight Recorder dumps {want}")
    if len(found) > 1:
        raise FlightRecorderError(f"{p}: dumps with several name prefixes ({', '.join(sorted(found))}); "
                                  "choose one with prefix= (--prefix)")
    return dict(sorted(next(iter(found.values())).items()))


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it refers to {module}.{name}; a Flight Recorder dump holds plain data only")


def read_dump(path: str | os.PathLike) -> dict[str, Any]:
    """One dump file (pickle or JSON) as a dict, or a one-line FlightRecorderError."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise FlightRecorderError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if not data:
        raise FlightRecorderError(f"{p}: empty file, not a Flight Recorder dump")
    try:
        dump = _NoClasses(io.BytesIO(data)).load() if data[:1] == b"\x80" else json.loads(data)
    except (pickle.UnpicklingError, EOFError, ValueError, UnicodeDecodeError, IndexError, KeyError) as exc:
        kind = "pickle" if data[:1] == b"\x80" else "JSON"
        raise FlightRecorderError(f"{p}: not a readable Flight Recorder dump ({kind}: {exc})") from None
    if not isinstance(dump, dict) or "entries" not in dump or not isinstance(dump.get("entries"), list):
        raise FlightRecorderError(f"{p}: not a Flight Recorder dump (no 'entries' list)")
    return dump


def rows_from_flight_recorder(path: str | os.PathLike, prefix: str | None = None) -> list[dict[str, Any]]:
    """Every entry of every rank's dump as a ledger row (``wb.collectives.ledger_table`` makes the table)."""
    rows: list[dict[str, Any]] = []
    for rank, f in dump_files(path, prefix).items():
        dump = read_dump(f)
        try:
            rows.extend(_rows(rank, dump))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise FlightRecorderError(f"{f}: a malformed Flight Recorder entry ({type(exc).__name__}: {exc})") from None
    return common_window(rows)


def common_window(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per collective group, drop the calls some rank's ring buffer no longer holds (sequence numbers
    below the latest first one): positional pairing would otherwise report a divergence that is not."""
    first: dict[str, dict[int, int]] = {}
    for r in rows:
        if ":p2p " not in r["group"]:
            ranks = first.setdefault(r["group"], {})
            ranks[r["rank"]] = min(ranks.get(r["rank"], r["seq"]), r["seq"])
    start = {g: max(v.values()) for g, v in first.items()}
    return [r for r in rows if r["seq"] >= start.get(r["group"], 0)]


def _rows(rank: int, dump: dict[str, Any]) -> list[dict[str, Any]]:
    config = dump.get("pg_config") or {}
    status = dump.get("pg_status") or {}
    entries = sorted(dump["entries"], key=lambda e: e.get("record_id", 0))
    # a coalesced group: several entries with one sequence number on one group, closed by a marker
    members: dict[tuple, int] = {}
    for e in entries:
        if not _marker(_title(e)[1].split(" ")[0]):
            members[_coalesce_key(e)] = members.get(_coalesce_key(e), 0) + 1
    rows, index = [], {}
    pairs: dict[str, int] = {}
    for e in entries:
        backend, title = _title(e)
        words = title.split(" ")
        name = words[0]
        if _marker(name) and members.get(_coalesce_key(e), 0):
            continue  # the marker closing a coalesced group whose calls are recorded one by one
        op = LEDGER_OPS.get(name, name)
        group = _pg_name(e)
        is_p2p = bool(e.get("is_p2p")) or op in P2P
        src = dst = None
        if op == "send" and len(words) > 1 and "->" in words[1]:
            src, dst = (int(x) for x in words[1].split("->"))
        elif op == "recv" and len(words) > 1 and "<-" in words[1]:
            dst, src = (int(x) for x in words[1].split("<-"))
        seq = int(e["p2p_seq_id"] if is_p2p else e["collective_seq_id"])
        ranks = _ranks(config, group, e)
        key_group = group
        if is_p2p:
            local = dst if op == "send" else src
            peer = ranks[local] if ranks and local is not None and 0 <= local < len(ranks) else local
            lo, hi = sorted((rank, rank if peer is None else int(peer)))
            key_group = f"{group}:p2p {lo}-{hi}"
            pairs[key_group] = pairs.get(key_group, 0) + 1
            seq, ranks = pairs[key_group], [lo, hi]
        sizes = [list(s) for s in (e.get("input_sizes") or [])]
        dtypes = [TORCH_DTYPES.get(d, str(d).lower()) for d in (e.get("input_dtypes") or [])]
        numel = sum(math.prod(s) for s in sizes)
        per = dtypes if len(dtypes) == len(sizes) else (dtypes[:1] * len(sizes))
        nbytes = sum(math.prod(s) * ITEMSIZE.get(d, 0) for s, d in zip(sizes, per, strict=False)) if per else None
        via = bucket = None
        key = _coalesce_key(e)
        if members.get(key, 0) > 1:
            via, bucket = "coalesced", index.get(key, 0)
            index[key] = bucket + 1
        caller, user = _frames_in(e.get("frames") or [])
        t0 = _seconds(e.get("time_created_ns"))
        done = _finished(e, status, seq, is_p2p)
        extra = e.get("workbench") if isinstance(e.get("workbench"), dict) else {}
        row = {
            "rank": rank, "session": "", "attempt": 0, "step": "", "group": key_group,
            "group_ranks": ranks, "seq": seq, "op": op, "dtypes": sorted(set(dtypes)), "shapes": sizes,
            "numel": numel, "bytes": nbytes, "src": src, "dst": dst, "via": via, "bucket": bucket,
            "bucket_tensors": None, "state": "completed" if done else "started", "error": None,
            "caller": caller, "user_frame": user, "t_start": t0,
            "t_end": _seconds(e.get("time_discovered_completed_ns")) if done else None,
            "c10d_op": f"{backend}:{title}" if backend else title,
        }
        row.update({k: v for k, v in extra.items() if k in EXTRAS})
        rows.append(row)
    return rows


def _title(e: dict[str, Any]) -> tuple[str, str]:
    """("nccl", "send 0->1") from the entry's profiling name."""
    backend, _, title = str(e["profiling_name"]).partition(":")
    return (backend, title) if title else ("", backend)


def _marker(name: str) -> bool:
    """NCCL closes a coalesced group with "coalesced" or "<OPTYPE>_coalesced" (ALLGATHER_coalesced ...)."""
    return name == "coalesced" or (name.endswith("_coalesced") and name.split("_")[0].isupper())


def _coalesce_key(e: dict[str, Any]) -> tuple:
    p2p = bool(e.get("is_p2p"))
    return (_pg_name(e), p2p, e.get("p2p_seq_id") if p2p else e.get("collective_seq_id"))


def _pg_name(e: dict[str, Any]) -> str:
    pg = e.get("process_group")
    name = pg[0] if isinstance(pg, (list, tuple)) and pg else None
    return str(name) if name not in (None, "") else str(e.get("pg_id", 0))


def _ranks(config: dict[str, Any], group: str, e: dict[str, Any]) -> list[int] | None:
    """The group's members from ``pg_config`` (gloo files the default group under the name "")."""
    desc = e.get("process_group", [None, None])[1] if isinstance(e.get("process_group"), (list, tuple)) else None
    cands = [config.get(group)] + [c for k, c in config.items() if k == "" and desc == "default_pg"]
    for c in cands:
        if isinstance(c, dict):
            try:
                ranks = json.loads(str(c.get("ranks", "[]")))
            except ValueError:
                continue
            if isinstance(ranks, list) and ranks:
                return [int(r) for r in ranks]
    return None


def _finished(e: dict[str, Any], status: dict[str, Any], seq: int, is_p2p: bool) -> bool:
    """Whether the call had finished when the dump was taken (gloo leaves every entry "scheduled")."""
    if e.get("state") == "completed" or e.get("retired") is True:
        return True
    if is_p2p:
        return False
    s = status.get(str(e.get("pg_id")))
    try:
        return s is not None and int(s.get("last_completed_collective", -1)) >= seq
    except (TypeError, ValueError):
        return False


def _frames_in(frames: list[Any]) -> tuple[str | None, str | None]:
    """(first frame past torch.distributed, first frame outside site-packages), as ``file:line name``."""
    caller = user = None
    for f in frames:
        if not isinstance(f, dict):
            continue
        fn = str(f.get("filename", ""))
        where = f"{fn}:{f.get('line', '?')} {f.get('name', '')}".rstrip()
        if any(p in fn for p in _PLUMBING):
            continue
        caller = caller or where
        if "site-packages" not in fn and "dist-packages" not in fn and not fn.startswith("<"):
            user = where
            break
    return caller, user


def _seconds(ns: Any) -> float | None:
    try:
        ns = float(ns)
    except (TypeError, ValueError):
        return None
    return ns / 1e9 if ns > 0 else None


def _peer(r: dict[str, Any], col: str) -> Any:
    """A point-to-point row's peer as its group rank (``group_dst``), else the older rows' ``dst``."""
    v = r.get(f"group_{col}")
    return v if v is not None and not (isinstance(v, float) and v != v) and v is not pd.NA else r.get(col)
