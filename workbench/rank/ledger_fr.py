"""Flight Recorder's record completing the calls ledger: the collectives no Python function issued.

The calls ledger (``ledger_calls.py``) sees what passes ``torch.distributed``'s Python functions; DDP's
reducer issues its bucket all-reduces (and its bucket-index broadcasts) from C++. PyTorch's own Flight
Recorder records every collective of every group, C++-issued ones included, with the Python frames of the
thread that issued it (reading of 2026-11-27, torch 2.13 CPU, gloo, 2 ranks, ``scripts/fr_gloo_reading.py``:
a DDP step's reducer all-reduce and broadcasts, FSDP2's all-gathers, 4-20 frames an entry; gloo's entries
stay ``scheduled``, with no end and no send/recv).

The calls ledger numbers each group's calls by the backend's own count (``ledger.backend_seq``: the same
number Flight Recorder gives as ``collective_seq_id``), so a call the ledger did not see is a gap in its
numbers. ``Complement.fill`` finds the gaps (one counter read per group: nothing is dumped while there are
none, as in an FSDP2 job whose calls all pass Python) and writes Flight Recorder's entries for them into the
ledger file as rows of its own (``"source": "flight_recorder"``): at each point, at close, and when a hang
or a post mortem reads the open calls. A row filled at a point or at close ends ``completed`` where Flight
Recorder says so (NCCL) and ``issued`` where it cannot (gloo: the job went on past it, its end unrecorded).
A row filled while the job is stuck (``hang=True``) for the newest call of its group, with no later call the
ledger knows of, is left open: the call the rank waits in, as far as the record can tell (on gloo the record
cannot say it is still running: the note says so).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from workbench.rank import ledger as _ledger

SOURCE = "flight_recorder"
ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # read when a process group is made
BUFFER = "2000"
TORCH_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
                "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
                "ComplexFloat": "complex64", "ComplexDouble": "complex128", "Float8_e4m3fn": "float8_e4m3fn",
                "Float8_e5m2": "float8_e5m2", "UInt16": "uint16", "UInt32": "uint32", "UInt64": "uint64"}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
            "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "uint16": 2, "uint32": 4, "uint64": 8}
NOTE = "recorded by Flight Recorder, not by the ledger (issued from C++, past torch.distributed's Python functions)"


def switch_on() -> bool:
    """Turn Flight Recorder on for the process groups made from now on, where the job set no size of its own (the
    default is off on some versions); False where the world group exists already (its size is fixed)."""
    if dist.is_available() and dist.is_initialized():
        return False
    if not any(os.environ.get(k) for k in ENVS):
        os.environ["TORCH_FR_BUFFER_SIZE"] = BUFFER
    return True


def records() -> bool:
    """Whether the process groups made from now on keep a Flight Recorder buffer (its size set above zero)."""
    return _env_size() > 0


def _env_size() -> int:
    """The ring's size the environment sets (0: none set, or off)."""
    for k in ENVS:
        try:
            n = int(os.environ.get(k) or 0)
        except ValueError:
            continue
        if n > 0:
            return n
    return 0


def _ring_size() -> int:
    """Flight Recorder's ring, in entries (what the environment set when the groups were made)."""
    return _env_size() or int(BUFFER)


DUMPS = ("_dump_fr_trace", "_dump_nccl_trace")  # torch 2.13's one dump; torch 2.11 keeps NCCL's apart
# what a renamed or reshaped API raises (a function gone, its arguments or its pickle's layout changed): torch
# changed, and the record can no longer be read, unlike a record that holds nothing (quiet)
API_FAULTS = (AttributeError, TypeError, ImportError, KeyError)


class Changed(RuntimeError):
    """Torch changed Flight Recorder's dump or the groups' table read here: raised out of ``Complement.fill`` once,
    so the capture says its one line ("Flight Recorder's record is no longer read") and goes on without the
    complement, rather than reading an empty record for ever while the calls it was to fill go unrecorded."""


_changed: Changed | None = None  # what ``groups()`` found changed (it answers no groups; ``Complement.fill`` raises)


def changed() -> Changed | None:
    """The API fault ``groups()`` met, if any (it answers no groups: its callers run on the job's points)."""
    return _changed


def _note_changed(what: str, exc: BaseException) -> None:
    global _changed
    if _changed is None:
        _changed = Changed(f"torch changed {what}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")


def dump(stacks: bool = True) -> list[dict[str, Any]]:
    """Every entry Flight Recorder holds in this process: its gloo buffer and, on versions that keep NCCL's apart
    (torch 2.11), NCCL's (the pickle dump: the json one carries no frames). A record that holds nothing, or a
    backend with none, is an empty list; an API-shaped failure (``API_FAULTS``) raises ``Changed``."""
    c10d = torch._C._distributed_c10d
    fns = [(name, getattr(c10d, name)) for name in DUMPS if hasattr(c10d, name)]
    if not fns:
        raise Changed(f"torch changed Flight Recorder's dump: none of {', '.join(DUMPS)} exists")
    out: list[dict[str, Any]] = []
    for name, fn in fns:
        try:
            raw = fn(True, stacks, False)  # includeCollectives, includeStackTraces, onlyActive
        except API_FAULTS as exc:
            raise Changed(f"torch changed Flight Recorder's dump: {name}: {type(exc).__name__}: {exc}") from exc
        except RuntimeError:  # c10d's own refusal: nothing recorded on that backend
            continue
        try:
            out += list(pickle.loads(raw).get("entries", []) or [])  # torch's own dump of this very process
        except API_FAULTS as exc:
            raise Changed(f"torch changed Flight Recorder's dump format: {name}: {type(exc).__name__}: {exc}") \
                from exc
        except (pickle.UnpicklingError, EOFError, ValueError):  # an empty or cut dump: nothing to read there
            continue
    return out


def groups() -> list[tuple[Any, str]]:
    """Every process group of this process with the name the ledger gives it. Never raises (each point marks
    through it); an API-shaped failure answers no groups and is kept (``changed``) for ``Complement.fill``."""
    if not dist.is_available():
        return []
    try:
        names = dict(dist.distributed_c10d._world.pg_names)
    except API_FAULTS as exc:
        _note_changed("the process groups' table (distributed_c10d._world.pg_names)", exc)
        return []
    except (RuntimeError, ValueError):  # c10d's own errors (its world torn down meanwhile): no groups to read
        return []
    out = []
    for pg, name in names.items():
        try:
            out.append((pg, pg.group_name or name or "default_pg"))
        except API_FAULTS as exc:
            _note_changed("a process group's name (ProcessGroup.group_name)", exc)
        except (RuntimeError, ValueError):  # c10d's own errors (a group being torn down): not one to read
            continue
    return out


def op_name(profiling: str) -> str:
    raw = str(profiling).split(":", 1)[-1]
    return _ledger.OP_NAMES.get(raw + "_", _ledger.OP_NAMES.get(raw, raw))


def frames(entry: dict[str, Any]) -> tuple[str, str, list[str], str]:
    """(caller, user frame, short stack, library frame) from an entry's frames (innermost first), by the ledger's
    own rules (``ledger.place``)."""
    raw = entry.get("frames") or []
    key = tuple((f.get("filename"), f.get("line"), f.get("name")) for f in raw)
    hit = _FRAMES.get(key)
    if hit is None:
        if len(_FRAMES) > 4096:
            _FRAMES.clear()
        hit = _FRAMES[key] = _frames(raw)
    return hit[0], hit[1], list(hit[2]), hit[3]


_FRAMES: dict[tuple, tuple[str, str, list[str], str]] = {}  # a training step issues its calls from a few places


def _frames(raw: list[dict[str, Any]]) -> tuple[str, str, list[str], str]:
    walked: list[tuple[str, str, bool]] = []
    for f in raw:
        fn = str(f.get("filename", ""))
        if _ledger.is_plumbing(fn):
            continue
        if _ledger.is_machinery(fn):
            break
        mine = not _ledger.is_library(fn)
        walked.append((fn, f"{fn}:{f.get('line')} {f.get('name')}", mine))
        if mine:
            break
    return _ledger.place(walked)


def _point_of(marks: list[tuple[str, dict[str, int]]], group: str, seq: int) -> str | None:
    """The first marked point whose count on ``group`` reaches call ``seq``: the point that call led to."""
    return next((st for st, counts in marks if seq <= counts.get(group, 0)), None)


class Complement:
    """Flight Recorder's entries for the calls a ledger (numbered by the backend) has no row of."""

    def __init__(self, book: _ledger.Ledger):
        self.book = book
        book.track_seen = True
        # group -> the backend's count accounted for: at install everything before is not this capture's
        self.done: dict[str, int] = {name: _ledger.backend_seq(pg) for pg, name in groups()}
        self.left_open: dict[str, dict[str, Any]] = {}  # group -> the row written open by a hang's read
        self.rows = 0  # rows written so far
        self.dumps = 0  # Flight Recorder read this many times
        # each point's step and every group's count then, not yet read: a read names each call by the point it led
        # to, however many points later it comes (a GPU job's capture reads every READ_EVERY points, on its writer)
        self.marks: list[tuple[str, dict[str, int]]] = []
        self._marks_lock = threading.Lock()
        self.late: dict[tuple[str, int], str | None] = {}  # (group, number) read before its entry: its point
        self.broken = False  # torch changed the record's API: said once (the fill that found it raised), then off

    def mark(self, step: str) -> None:
        """A point is reached: the calls issued so far belong to ``step`` (one counter read per group)."""
        counts = {name: _ledger.backend_seq(pg) for pg, name in groups()}
        with self._marks_lock:
            self.marks.append((step, counts))

    def due(self, every: int) -> bool:
        """Whether to read the record now: ``every`` points marked since the last read, or so many calls unread
        that the ring (its size from the environment) could wrap before the next read."""
        with self._marks_lock:
            if not self.marks:
                return False
            if len(self.marks) >= every:
                return True
            newest = self.marks[-1][1]
        unread = sum(max(0, n - self.done.get(name, 0)) for name, n in newest.items())
        return unread * 2 > _ring_size()

    def gaps(self, upto: dict[str, int] | None = None) -> dict[str, tuple[Any, set[int], int]]:
        """group -> (its group, the numbers the backend gave that the ledger has no row of, the backend's count);
        ``upto``: each group's count to stop at (a point's, read later by the capture's writer)."""
        out = {}
        for pg, name in groups():
            live = _ledger.backend_seq(pg)
            n = live if upto is None else min(live, upto.get(name, 0))
            lo = self.done.get(name, 0)
            if n <= lo:
                continue
            seen = self._seen(name)
            if seen and max(seen) > live + 1:
                # the ledger numbered past the backend's count (calls the backend counted as one: a coalescing
                # block): its numbers are no longer Flight Recorder's, so a gap is no missed call
                self._account(name, n)
                continue
            taken = self._taken(name)  # a point-to-point call's number: the ledger has its row on its channel
            missing = {s for s in range(lo + 1, n + 1) if s not in seen and s not in taken}
            if missing:
                out[name] = (pg, missing, n)
            else:
                self._account(name, n)
        return out

    def _seen(self, name: str) -> set[int]:
        """The numbers the ledger wrote rows of on ``name`` (a copy: the job's thread adds to it meanwhile)."""
        return self.book.seen_on(name)

    def _taken(self, name: str) -> set[int]:
        return self.book.taken_on(name)

    def _fr_id(self, name: str, q: int, taken: set[int]) -> int:
        """Flight Recorder's ``collective_seq_id`` of the backend's number ``q``: gloo numbers point-to-point calls
        with the collectives, Flight Recorder's collective count does not (without this, a job's barrier after a
        send was written again from the record as a C++ call: ``barrier #1`` beside the ledger's ``barrier #2``)."""
        return q - self.book.p2p_before.get(name, 0) - sum(1 for p in taken if p < q)

    def _account(self, name: str, n: int) -> None:
        self.done[name] = n
        self.book.settled_upto(name, n)

    def fill(self, when: str, hang: bool = False, marked_only: bool = False) -> int:
        """Write the rows the ledger lacks; returns how many. ``when``: what read them ("before point `step3`", "at
        close", "while the rank waits"); ``hang``: the rank may be stuck: a group's newest call stays open.
        ``marked_only``: only the calls up to the newest point marked (the capture's writer, while the job goes on).
        A call is named by the first point marked after it (else by the ledger's step now)."""
        if self.book.off or self.broken:
            return 0
        with self._marks_lock:
            marks = list(self.marks)
        if marked_only and not marks:
            return 0
        try:
            return self._fill(when, hang, marks, marks[-1][1] if marked_only else None)
        except Changed:
            self.broken = True  # raised once: the capture says it and goes on without the complement
            raise
        finally:
            with self._marks_lock:
                del self.marks[:len(marks)]

    def _fill(self, when: str, hang: bool, marks: list[tuple[str, dict[str, int]]],
              upto: dict[str, int] | None) -> int:
        self._close_left_open(everything=not hang)
        gaps = self.gaps(upto)
        if changed() is not None:  # no groups read (their table changed): not "nothing to fill"
            raise changed()
        if not gaps:
            return 0
        self.dumps += 1
        # each gap's number as Flight Recorder counts -> the backend's (the ledger's) number
        wanted = {}
        for name, (_, missing, _) in gaps.items():
            taken = self._taken(name)
            wanted[name] = {self._fr_id(name, q, taken): q for q in missing}
        by_group: dict[str, list[dict[str, Any]]] = {}
        for e in dump():
            pgid = e.get("process_group")
            name = str(pgid[0]) if isinstance(pgid, (list, tuple)) and pgid else str(pgid)
            if name in gaps and not e.get("is_p2p") and e.get("collective_seq_id") in wanted[name]:
                by_group.setdefault(name, []).append({**e, "collective_seq_id": wanted[name][e["collective_seq_id"]]})
        written = 0
        out: list[dict[str, Any]] = []  # every row of this read, written at once
        for name, (pg, missing, n) in gaps.items():
            entries = sorted({e["collective_seq_id"]: e for e in by_group.get(name, [])}.values(),
                             key=lambda e: e["collective_seq_id"])
            # A number the backend gave with no entry in the record yet: NCCL numbers a group's first call before
            # it creates the communicator (hundreds of ms) and records it after, so a read in between (another
            # thread's: the writer, the hang watcher) finds the number and not the call. Accounted only up to it,
            # it is read next time; only a number the ring has wrapped past is given up.
            found = {int(e["collective_seq_id"]) for e in entries}
            late = sorted(q for q in missing if q not in found and n - q < _ring_size())
            for q in late:  # named then by the point it led to, which this read's marks know
                self.late.setdefault((name, q), _point_of(marks, name, q))
            try:
                ranks = dist.get_process_group_ranks(pg)
            except (KeyError, ValueError, RuntimeError):  # a group torch no longer registers (destroyed meanwhile)
                ranks = None
            newest = max(self._seen(name) | {0})
            for e in entries:
                seq = int(e["collective_seq_id"])
                still = hang and seq == entries[-1]["collective_seq_id"] and seq > newest and \
                    e.get("state") != "completed"
                step = self.late.pop((name, seq), None) or _point_of(marks, name, seq)
                rec = self._row(e, name, ranks, seq, step)
                out.append(rec)
                if still:
                    self.left_open[name] = rec
                else:
                    state = "completed" if e.get("state") == "completed" else "issued"
                    note = NOTE + ("" if state == "completed" else f"; its end is not in the record, read {when}")
                    out.append(self._end_row(rec, state, note))
                written += 1
            self._account(name, late[0] - 1 if late else n)
        self.book.write_many(out)
        self.rows += written
        return written

    def _close_left_open(self, everything: bool) -> None:
        """A row left open by a hang's read whose group has gone on since (``everything``: a point or close, which
        the rank reached past it): the rank went past it."""
        for name, rec in list(self.left_open.items()):
            pg = next((p for p, n in groups() if n == name), None)
            if everything or pg is None or _ledger.backend_seq(pg) > rec["seq"]:
                self._end(rec, "issued", NOTE + "; read open while the rank waited, its group went on after it")
                del self.left_open[name]

    def _row(self, e: dict[str, Any], name: str, ranks: list[int] | None, seq: int,
             step: str | None = None) -> dict[str, Any]:
        dtypes = [TORCH_DTYPES.get(d, str(d).lower()) for d in (e.get("input_dtypes") or [])]
        sizes = [list(s) for s in (e.get("input_sizes") or [])]
        per = dtypes if len(dtypes) == len(sizes) else dtypes[:1] * len(sizes)
        numel = [int(torch.Size(s).numel()) for s in sizes]
        caller, user, stack, lib = frames(e)
        created = e.get("time_created_ns")
        profiling = str(e.get("profiling_name") or "")
        return {
            "ev": "start", "rank": self.book.rank, "session": self.book.session, "attempt": self.book.attempt,
            "step": self.book.step if step is None else step,
            "group": name, "group_ranks": ranks, "seq": seq, "op": op_name(profiling),
            "c10d_op": profiling, "dtypes": sorted(set(dtypes)), "shapes": sizes, "numel": sum(numel),
            "bytes": sum(k * ITEMSIZE.get(d, 0) for k, d in zip(numel, per)),
            "device": "cuda" if profiling.startswith("nccl") else "cpu",
            "src": None, "dst": None, "group_src": None, "group_dst": None, "tag": None,
            "t": created / 1e9 if isinstance(created, (int, float)) else time.time(), "send": {}, "recv": {},
            "caller": caller, "user_frame": user, "stack": stack, "library_frame": lib, "label": None,
            "source": SOURCE,
        }

    def _end(self, rec: dict[str, Any], state: str, note: str) -> None:
        self.book.write(self._end_row(rec, state, note))

    @staticmethod
    def _end_row(rec: dict[str, Any], state: str, note: str) -> dict[str, Any]:
        return _ledger.end_row(rec, state, note=note, source=SOURCE)
