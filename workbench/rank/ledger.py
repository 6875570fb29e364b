"""The per-rank collectives ledger: every collective a step issues, readable while stuck.

Runs inside a rank. A ``TorchDispatchMode`` sees every ``c10d`` op this rank's step
thread dispatches: the Python wrappers (``dist.all_reduce`` ...), what FSDP1 and FSDP2
issue internally (all-gathers, reduce-scatters) and what C++ issues on our behalf, such
as each per-dtype bucket of ``_broadcast_coalesced`` (FSDP1 ``sync_module_states``).
Each call appends one JSON line when it starts and one when its work completes, fails
or times out (the work's future callback), to ``<dir>/rank<r>.jsonl``, flushed per
record: the client reads the file from disk while the rank is still blocked inside the
collective. Flight Recorder covers part of this (gloo entries stay "scheduled", no
send/recv, and its dump needs the rank to answer), so it is only a cross-check here:
``flight_recorder()`` returns its entries when the rank can answer.

Completion: gloo and async NCCL ops return a Work (alone, or after their tensors) whose future marks the
end; the op only queues it, the caller waits on it after, so a row never ends as the op returns (a barrier
did: a deadlock through it was never proven). A gloo work without a future (send, recv, reduce_scatter) is
asked by the watcher thread below, and a synchronous one also ends where its thread goes on past it (gloo's
reduce_scatter work never says it is done). A synchronous NCCL op returns none (it runs on the current
stream), so a CUDA event recorded after it, polled by one watcher thread, marks it. Measured on 2 x H200
(torch 2.11, NCCL 2.28.9, ``benchmarks/ledger_nccl.py``): in the eval-loop hang each rank's earliest open
call is the mismatched pair (all_reduce #13 vs all_gather_into_tensor #13, rank 1 had
queued 3 more behind it).

Sequence numbers count per process group and per session attempt from 1, so the ranks'
n-th calls on a group line up; send/recv count per directed channel (group ``0:0->1``).
Each row says what this rank sends to and receives from each peer (``rank/traffic.py``),
the user's line and the library's that issued it. Functional collectives (DTensor's) end
at their ``wait_tensor``. Seen on CPU: DDP's reducer all-reduces (autograd runs CPU work
on the calling thread). Not seen: collectives issued from other threads. Cost: every aten
op of a step passes one Python check (a tiny Qwen3 CPU forward: 4.2 ms -> 6.0 ms).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import sys
import sysconfig
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypedDict

import torch
import torch.distributed as dist
import typing_extensions
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.rank import agree, control, patch
from workbench.rank.traffic import traffic

NAMESPACES = ("c10d", "_c10d_functional")
# calls after which what they carry holds the same bytes on every rank of the group (rank/agree.py)
SYNCING = {"broadcast_": "broadcast", "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce"}
OP_NAMES = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce_coalesced", "broadcast_": "broadcast",
    "_allgather_base_": "all_gather_into_tensor", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "allgather_coalesced_": "all_gather_coalesced", "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all_single", "barrier": "barrier", "monitored_barrier_": "monitored_barrier",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv_any_source",
}
# functional collectives' wait and autograd wrapper; NCCL's NaN check (TORCH_NCCL_NAN_CHECK), no collective
SKIP_OPS = {"wait_tensor", "_wrap_tensor_autograd", "check_for_nan"}
PAYLOAD_ARGS = ("input_tensor", "input_tensors", "inputs", "input_list", "input", "tensors", "tensor")
PEER_ARGS = {"root_rank": "src", "dst": "dst", "src": "src"}
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKBENCH = os.path.dirname(_HERE)
# The lab's models, roles and receivers stand where a library would in the incident: never the user's line.
# A path, not an import: rank/ never imports lab/.
_LAB = os.path.join(_WORKBENCH, "lab")
_TORCH_DISTRIBUTED = os.path.join(os.path.dirname(torch.__file__), "distributed")
# torch's own modules that issue collectives (FSDP, DTensor, the state-dict loaders; DDP in torch/nn/parallel), and
# autograd's engine (a call C++ issues inside a backward: DDP's reducer): a library's line beside the user's
_TORCH_DISTRIBUTED_CODE = (_TORCH_DISTRIBUTED + os.sep, os.path.join(_TORCH_DIR, "nn", "parallel") + os.sep)
_AUTOGRAD = os.path.join(_TORCH_DIR, "autograd") + os.sep
_STDLIB = sysconfig.get_paths().get("stdlib", "")
_PLUMBING = (
    os.path.join(_TORCH_DIR, "distributed", "distributed_c10d.py"),
    os.path.join(_TORCH_DIR, "distributed", "c10d_logger.py"),
    os.path.join(_TORCH_DIR, "utils", "_python_dispatch.py"),
    os.path.join(_TORCH_DIR, "_ops.py"),
    os.path.join(_TORCH_DIR, "_dynamo"),
    os.path.join(_TORCH_DIR, "_compile.py"),
    os.path.join(_TORCH_DIR, "utils", "_contextlib.py"),
    os.path.join(_TORCH_DIR, "distributed", "_functional_collectives.py"),
    os.path.join(_TORCH_DIR, "overrides.py"),  # a TorchFunctionMode's dispatch (poison's, torch.device's)
    os.path.join(_TORCH_DIR, "utils", "_device.py"),
    os.path.abspath(__file__),
    os.path.join(_HERE, "poison.py"),  # the workbench's own modes: never the caller
    os.path.join(_HERE, "trace.py"),
    *(os.path.abspath(m.__file__) for m in (typing_extensions,)),  # torch's @deprecated wrapper of c10d calls
)
_SHIPPED = "<dynamic-code>"  # cloudpickle's co_filename for code sent by value: the user's own
# Code the user shipped (cloudpickle, IPython cells) and the catalogue's scenario files, even where the
# workbench is installed into site-packages.
_USER_PREFIXES = (_SHIPPED, "<ipython-input", os.path.join(os.path.dirname(_HERE), "scenarios") + os.sep)


# The engine's own machinery: ipyparallel runs the step from a kernel, on an event loop. Never the user's code
# (even where these packages sit outside site-packages, as on a host that carries them as wheels) and never the
# library that issued a call: past them no frame issued anything.
_MACHINERY = re.compile(r"[/\\](ipyparallel|ipykernel|IPython|tornado|zmq|traitlets|jupyter_client)[/\\]"
                        r"|^<frozen runpy>")  # not asyncio: a library's own event loop may sit below the user's line


class StartRow(TypedDict, total=False):
    """A call's start line (``ev: start``), written before the call runs: what the readers key on."""

    ev: str
    rank: int
    session: str
    attempt: int
    step: str | None
    group: str
    group_ranks: list[int]
    seq: int
    op: str
    c10d_op: str
    dtypes: list[str]
    shapes: list[list[int]]
    numel: int
    bytes: int
    device: str
    src: int | None
    dst: int | None
    group_src: int | None
    group_dst: int | None
    tag: Any
    t: float
    send: dict[str, Any]
    recv: dict[str, Any]
    caller: str
    user_frame: str
    stack: list[str]
    library_frame: str
    label: str | None
    source: str  # where a row not seen by the wrapper came from (Flight Recorder's)
    via: str
    bucket: int
    bucket_tensors: int | None


class EndRow(TypedDict, total=False):
    """A call's end line (``ev: end``), matched to its start by (session, attempt, group, seq)."""

    ev: str
    rank: int
    session: str
    attempt: int
    group: str
    seq: int
    state: str  # completed | failed | timed out | issued (its end never seen)
    error: str | None
    t: float
    note: str | None
    source: str


def end_row(start: StartRow | dict[str, Any], state: str, *, error: str | None = None, note: str | None = None,
            source: str | None = None) -> EndRow:
    """The end line of the call ``start`` opened: the one place an end row is built."""
    row: EndRow = {"ev": "end", "rank": start.get("rank"), "session": start.get("session"),
                   "attempt": start.get("attempt"), "group": start.get("group"), "seq": start.get("seq"),
                   "state": state, "error": error, "t": time.time(), "note": note}
    if source is not None:
        row["source"] = source
    return row


def ledger_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.jsonl")


_LABELS = threading.local()


@contextlib.contextmanager
def label(text: str) -> Iterator[None]:
    """Say, in the ledger, what the collectives issued inside this block are for ("the conversion task for
    `bias`, spec cached at sync 1"): code that builds a collective from cached state can name that state,
    and a mismatch then reads as its cause, not only as two calls that part. Nested labels join with "; "."""
    stack = getattr(_LABELS, "stack", None)
    if stack is None:
        stack = _LABELS.stack = []
    stack.append(text)
    try:
        yield
    finally:
        stack.pop()


def current_label() -> str | None:
    stack = getattr(_LABELS, "stack", None)
    return "; ".join(stack) if stack else None


class Ledger:
    """Append-only JSON-lines writer for one rank and one session attempt."""

    def __init__(self, directory: str, rank: int, session: str = "", attempt: int = 0):
        os.makedirs(directory, exist_ok=True)
        self.path = ledger_path(directory, rank)
        self.rank, self.session, self.attempt = rank, session, attempt
        self.step = ""
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1)
        self._open: dict[tuple, dict[str, Any]] = {}  # (group, seq) -> start line: calls whose end is unwritten
        # group -> the numbers of the calls written, kept only where Flight Recorder's complement reads them
        # (``ledger_fr.Complement``: it prunes them as it accounts for them)
        self.seen: dict[str, set[int]] = {}
        self.track_seen = False
        # group -> the backend's numbers its point-to-point calls took (gloo counts them with the collectives;
        # Flight Recorder's ``collective_seq_id`` does not): kept where ``track_seen`` is
        self.p2p_taken: dict[str, set[int]] = {}
        self.p2p_before: dict[str, int] = {}  # group -> how many such numbers lie below those kept (pruned)
        self._closing = False
        # A guest in someone's job (``workbench.job``): ``guest(exc)`` hears of the recorder's own failures (a full
        # disk, a bug) instead of the job, and the ledger goes ``off`` (its modes pass every call through).
        # None (live sessions): they raise, as before.
        self.guest: Any = None
        self.off = False

    def write(self, record: dict[str, Any]) -> None:
        self.write_many([record])

    # what Flight Recorder's complement (``ledger_fr.Complement``) reads of the numbers this ledger wrote, each a
    # copy or an update under the ledger's lock (the job's thread writes meanwhile)
    def seen_on(self, group: str) -> set[int]:
        """The numbers this ledger wrote rows of on ``group``."""
        with self._lock:
            return set(self.seen.get(group, ()))

    def taken_on(self, group: str) -> set[int]:
        """The backend numbers point-to-point calls took on ``group`` (gloo counts them with the collectives)."""
        with self._lock:
            return set(self.p2p_taken.get(group, ()))

    def settled_upto(self, group: str, n: int) -> None:
        """Forget what is known up to number ``n`` on ``group`` (the complement read that far), keeping how many
        point-to-point numbers lay below."""
        with self._lock:
            seen = self.seen.get(group)
            if seen:
                seen.difference_update([s for s in seen if s <= n])
            taken = self.p2p_taken.get(group)
            if taken:
                below = [p for p in taken if p <= n]
                taken.difference_update(below)
                self.p2p_before[group] = self.p2p_before.get(group, 0) + len(below)

    def write_many(self, records: list[dict[str, Any]]) -> None:
        """The records in order, in one write and one flush (Flight Recorder's calls come by the hundred)."""
        if self.off or not records:
            return
        text = "".join(json.dumps(record, default=str) + "\n" for record in records)
        try:
            with self._lock:
                if self._file.closed:
                    return
                self._file.write(text)
                self._file.flush()
                for record in records:
                    self._account(record)
        except (OSError, ValueError) as exc:  # a full disk, a file closed under us: the callers' boundaries say a bug
            self.fail(exc)

    def _account(self, record: dict[str, Any]) -> None:
        key = (record.get("group"), record.get("seq"))
        if record.get("ev") == "start":
            self._open[key] = record
            if self.track_seen and isinstance(record.get("seq"), int):
                self.seen.setdefault(str(record.get("group")), set()).add(record["seq"])
        elif record.get("ev") == "end":
            self._open.pop(key, None)
            if self._closing and not self._open:  # the last call still running at close() has ended
                self._file.close()
                _CLOSING.discard(self)

    def fail(self, exc: BaseException) -> None:
        """The recorder's own error: the guest's (once; the ledger is off from here), else raised."""
        if self.guest is None:
            raise exc
        if not self.off:
            self.off = True
            _CLOSING.discard(self)
            self.guest(exc)

    def open_calls(self) -> list[dict[str, Any]]:
        """The calls started and not (yet) ended, oldest first."""
        with self._lock:
            return list(self._open.values())

    def next_seq(self, group: str, floor: int = 0) -> int:
        """The group's next call number: one past the last, or ``floor`` (the backend's own count, where the
        ledger numbers calls as Flight Recorder does) where that is higher."""
        with self._lock:
            self._seq[group] = max(self._seq.get(group, 0) + 1, floor)
            return self._seq[group]

    def close(self, settle_later: bool = False) -> None:
        """Stop the ledger. ``settle_later`` (a job's capture): a call still running (an asynchronous one the job
        waits on after ``close()``, an NCCL kernel still on the device) keeps the file open until its end is
        written: at its work's completion, at ``destroy_process_group``, at the latest at interpreter exit
        (``_at_exit``), so no call of a job that went on reads as running."""
        if settle_later:
            settle()
        with self._lock:
            if self._file.closed:
                return
            if settle_later and self._open:
                self._closing = True
                _CLOSING.add(self)
                _watch_destroy()
                return
            self._file.close()

    def abandon(self, note: str) -> int:
        """End every call still open as issued (its end unseen), with ``note``; close the file."""
        with self._lock:
            left = list(self._open.values())
        for rec in left:
            self.write(end_row(rec, "issued", note=note))
        with self._lock:
            self._open.clear()
            if not self._file.closed:
                self._file.close()
        _CLOSING.discard(self)
        return len(left)


class _Recorder(TorchDispatchMode):
    def __init__(self, ledger: Ledger):
        super().__init__()
        self.ledger = ledger
        self.coalesced: list[dict[str, Any]] = []  # context set by the _broadcast_coalesced wrapper
        self.functional: dict[tuple, dict[str, Any]] = {}  # output tensor -> its functional call, until waited
        self._patched: tuple[Any, Any] | None = None  # (functional collectives module, its own wait_tensor)
        self._device: torch.device | None = None
        self._last_device: torch.device | None = None
        self._p2p: tuple[Any, str, int] | None = None  # a point-to-point call's group and its backend count before
        self._last_async = True  # the call's own ``async_op`` (False: its caller waits on it before going on)
        # synchronous calls whose work gives no future, watched until ``is_completed()``: the thread going on past
        # them (its next call, the Python function's return) says they ended where the work never does
        self.unsaid: list[tuple[dict[str, Any], Any]] = []
        # Number each group's calls by the backend's own count (Flight Recorder's ``collective_seq_id``), so the
        # calls it records and this recorder does not (DDP's C++ all-reduces) fill the gaps (``ledger_fr.py``).
        # The capture's calls ledger sets it; the full mode (live sessions) counts its own calls from 1.
        self.backend_seq = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in NAMESPACES or self.ledger.off:  # off: a guest's ledger that failed
            if self.unsaid:  # the thread went on past a synchronous call whose work never says it ended
                self.went_on()
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name in SKIP_OPS:  # not collectives of their own; a wait ends the functional call it waits on
            return self._wait(func, args, kwargs) if name == "wait_tensor" else func(*args, **kwargs)
        try:
            rec = self._start(func, args, kwargs)
        except Exception as exc:  # a boundary: the job's op never sees the recorder's fault; fail() says it
            self.ledger.fail(exc)  # raises, unless a guest's: then the call runs unrecorded
            return func(*args, **kwargs)
        self._device = self._last_device
        p2p, self._p2p = self._p2p, None
        out = self._run(rec, func, args, kwargs)
        try:
            if p2p is not None:
                self._took(*p2p)
            return self._after(func, rec, out)
        except Exception as exc:  # a boundary: the job's op returns its result whatever the recorder met
            self.ledger.fail(exc)
            return out

    def _run(self, rec: dict[str, Any] | None, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` called; where it raises, ``rec``'s row (if any) ends with that failure and it is raised again."""
        try:
            return func(*args, **kwargs)
        except BaseException as exc:  # the call's own failure, whatever it is (an interrupt too), ends its row
            if rec is not None:
                self._end(rec, exc)
            raise

    def _after(self, func, rec: dict[str, Any], out: Any) -> Any:
        """Where the call ends: its work's future, its CUDA events, a functional call's wait."""
        if func.namespace == "_c10d_functional":
            # A functional collective returns at once; its ``wait_tensor`` (DTensor's, FSDP2's) is where it ends.
            self._patch_wait()
            for t in _tensors(out):
                self.functional[_key(t)] = rec
            return out
        # (tensors, Work) or a bare Work (barrier, send, recv, gather, reduce, all_to_all_single, the coalesced
        # ones): the op only queues it, the caller waits on it after; no Work (monitored_barrier): the op itself
        # blocked until its end
        work = out[1] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.ScriptObject) \
            else out if isinstance(out, torch.ScriptObject) else None
        if work is None and not (self._device is not None and self._device.type == "cuda"):
            self._end(rec, None)
            return out
        try:
            unboxed = dist.distributed_c10d.Work.unbox(work)
        except (RuntimeError, TypeError):  # no Work in there (a synchronous NCCL op's None): the binding refuses it
            unboxed = None
        if unboxed is not None and self._device is not None and self._device.type == "cuda":
            # An NCCL work's future completes when the kernel is queued, not when it ends (a
            # mispaired broadcast then looks done while its kernel waits forever): poll the
            # work's own CUDA events instead.
            _watch(_WorkQuery(unboxed), lambda note=None, rec=rec: self._end(
                rec, None, device=True, **({'state': 'issued', 'note': note} if note else {})))
        elif unboxed is not None:
            try:
                fut = unboxed.get_future()
            except RuntimeError:  # gloo's reduce_scatter work has none ("Work::getFuture not implemented")
                fut = None
            if fut is None:  # gloo's send, recv and reduce_scatter: asked until it says it is done
                self._watch_work(rec, unboxed)
            else:
                fut.add_done_callback(lambda f, rec=rec: self._end(rec, _future_error(f)))
        elif self._device is not None and self._device.type == "cuda":
            # NCCL runs a synchronous op on the current stream and returns no Work: an event after it marks the end.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
            _watch(event, lambda note=None, rec=rec: self._end(
                rec, None, device=True, **({'state': 'issued', 'note': note} if note else {})))
        return out

    def _took(self, pg: Any, name: str, before: int) -> None:
        """The number a point-to-point call took in its group's backend count, where it took one."""
        after = backend_seq(pg, self._last_device)
        if after > before:
            with self.ledger._lock:
                self.ledger.p2p_taken.setdefault(name, set()).add(after)

    def _watch_work(self, rec: dict[str, Any], work: Any) -> None:
        """End ``rec`` when ``work`` (a CPU work without a future) says it is done; a synchronous call's also when
        the thread goes on past it (``went_on``): gloo's reduce_scatter work never says so."""
        item = _watch(_WorkQuery(work), lambda note=None, rec=rec: self._end(rec, _work_error(work)))
        if not self._last_async:
            self.unsaid.append((rec, item))

    def went_on(self) -> None:
        """The thread went on past its synchronous calls (its next call, the Python function's return): those
        still watched ended there."""
        unsaid, self.unsaid = self.unsaid, []
        for rec, item in unsaid:
            if _unwatch(item):
                self._end(rec, None, note="its work never said it ended; its caller went on past it")
        if _PENDING:  # the works that say so (a gloo send waited on) ended now, not at the watcher's next poll
            _poll_once()

    def _wait(self, func, args, kwargs):
        rec = self.functional.pop(_key(args[0]), None) if args and isinstance(args[0], torch.Tensor) else None
        out = self._run(rec, func, args, kwargs)
        if rec is not None and not any(r is rec for r in self.functional.values()):  # a coalesced call's last output
            self._end(rec, None)
        return out

    def _patch_wait(self) -> None:
        """Also see the waits that run where this mode is off: an ``AsyncCollectiveTensor`` waits inside its
        own ``__torch_dispatch__``, below the modes, through the module's ``wait_tensor``."""
        fc = sys.modules.get("torch.distributed._functional_collectives")
        if self._patched is not None or fc is None:
            return
        original = fc.wait_tensor

        def wait_tensor(tensor):
            return self._wait(original, (tensor,), {})

        fc.wait_tensor = wait_tensor
        self._patched = (fc, original)

    def finish(self) -> None:
        """Functional calls this step issued and never waited on: dispatched, their end unseen."""
        self.went_on()
        if self._patched is not None:
            self._patched[0].wait_tensor = self._patched[1]
            self._patched = None
        for rec in {id(r): r for r in self.functional.values()}.values():
            self._end(rec, None, state="issued", note="a functional collective nobody waited on in this step")
        self.functional.clear()

    def _start(self, func, args, kwargs) -> dict[str, Any]:
        self.went_on()
        self._p2p = None
        schema = func._schema
        raw = schema.name.split("::")[-1]
        bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema.arguments)}
        pg = _group(bound)
        group, ranks = "?", None
        if pg is not None:
            group = pg.group_name or "default_pg"
            try:
                ranks = dist.get_process_group_ranks(pg)
            except (KeyError, ValueError, RuntimeError):  # a group torch no longer registers (aborted, destroyed)
                ranks = list(range(pg.size()))
        me = ranks.index(self.ledger.rank) if ranks and self.ledger.rank in ranks else 0
        members = ranks  # the group's global ranks, before a point-to-point call narrows them to its channel
        theirs, send, recv = traffic(raw, bound, me, len(ranks) if ranks else 1)
        payload: list[torch.Tensor] = []
        for name in PAYLOAD_ARGS:
            if name in bound and bound[name] is not None:
                payload = _tensors(bound[name])
                break
        # a receiver that passes nothing to send (a scatter's non-source): what it receives into
        payload = payload or theirs
        if raw in SYNCING and members and not self.coalesced:
            agree.synced(payload, members, SYNCING[raw])  # what it carries agrees across the group from now on
        if raw in P2P and ranks:
            # Point-to-point calls pair per directed channel (the k-th send from a to b with b's k-th
            # receive from a), not in the group's collective order: a batch_isend_irecv may post in any order.
            peer = next(iter(send or recv))
            if peer != "?":
                a, b = (self.ledger.rank, ranks[int(peer)]) if send else (ranks[int(peer)], self.ledger.rank)
                group, ranks = f"{group}:{a}->{b}", [a, b]
                # peers as indices into [a, b]: the sender is 0, the receiver 1
                send = {"1": next(iter(send.values()))} if send else {}
                recv = {"0": next(iter(recv.values()))} if recv else {}
        self._last_device = payload[0].device if payload else None
        self._last_async = bool(bound.get("async_op", True))
        if raw in P2P and pg is not None and self.ledger.track_seen:
            self._p2p = (pg, pg.group_name or "default_pg", backend_seq(pg, self._last_device))
        floor = backend_seq(pg, self._last_device) + 1 if self.backend_seq and pg is not None and raw not in P2P \
            else 0
        rec: StartRow = {
            "ev": "start", "rank": self.ledger.rank, "session": self.ledger.session,
            "attempt": self.ledger.attempt, "step": self.ledger.step, "group": group,
            "group_ranks": ranks, "seq": self.ledger.next_seq(group, floor), "op": OP_NAMES.get(raw, raw),
            "c10d_op": schema.name, "dtypes": sorted({str(t.dtype).replace("torch.", "") for t in payload}),
            "shapes": [list(t.shape) for t in payload], "numel": sum(t.numel() for t in payload),
            "bytes": sum(t.numel() * t.element_size() for t in payload),
            "device": str(payload[0].device) if payload else "",
            "src": None, "dst": None, "group_src": None, "group_dst": None, "tag": bound.get("tag"), "t": time.time(),
            "send": send, "recv": recv,
        }
        for arg, col in PEER_ARGS.items():
            if bound.get(arg) is not None:
                # c10d passes the group's own rank (``group_src``); the user's code names the global one (``src``)
                local = bound[arg]
                rec[f"group_{col}"] = local
                rec[col] = (members[local] if members and isinstance(local, int) and 0 <= local < len(members)
                            else local)
        rec["caller"], rec["user_frame"], rec["stack"], rec["library_frame"] = _frames()
        rec["label"] = current_label()
        if self.coalesced and raw == "broadcast_":
            ctx = self.coalesced[-1]
            rec["via"] = "_broadcast_coalesced"
            rec["bucket"] = ctx["buckets"]
            ctx["buckets"] += 1
            same = [n for d, n in ctx["tensors"] if payload and d == payload[0].dtype]
            rec["bucket_tensors"] = len(same) if sum(same) == rec["numel"] else None
        self.ledger.write(rec)
        return rec

    def _end(self, rec: dict[str, Any], error: BaseException | None, state: str | None = None,
             note: str | None = None, device: bool = False) -> None:
        try:
            self._end_line(rec, error, state, note, device)
        except Exception as exc:  # a boundary: the job's thread (or a backend's callback) never sees our fault
            self.ledger.fail(exc)

    def _end_line(self, rec: dict[str, Any], error: BaseException | None, state: str | None,
                  note: str | None, device: bool) -> None:
        if state is None:
            state = "completed" if error is None else ("timed out" if _is_timeout(error) else "failed")
        text = None if error is None else f"{type(error).__name__}: {str(error)[:500]}"
        if text is not None and control.aborted():  # released by recovery, not failed or timed out on its own
            state, text = "failed", f"aborted by the workbench's recovery ({text})"
        elif device and state == "completed" and control.aborted():  # an NCCL kernel that ended only at the abort
            state, text = "failed", "aborted by the workbench's recovery (its work ended at the abort, not done)"
        self.ledger.write(end_row(rec, state, error=text, note=note))


_PENDING: list[tuple[Any, Any]] = []  # (cuda event, callback) polled by one watcher thread
_PENDING_LOCK = threading.Lock()
_WATCHER: list[threading.Thread] = []


_CLOSING: set[Ledger] = set()  # ledgers closed with calls still running: their ends come later


class _WorkQuery:
    """A c10d Work seen as something with ``query()``: done once its device work finished."""

    def __init__(self, work: Any):
        self.work = work

    def query(self) -> bool:
        try:
            return bool(self.work.is_completed())
        except RuntimeError:  # c10d's errors (a failed or aborted work): done, its end says how
            return True


def _watch(event: Any, done: Any) -> tuple[Any, Any]:
    item = (event, done)
    with _PENDING_LOCK:
        _PENDING.append(item)
        if not _WATCHER or not _WATCHER[0].is_alive():
            _WATCHER[:] = [threading.Thread(target=_poll_events, name="ledger-events", daemon=True)]
            _WATCHER[0].start()
    return item


def _unwatch(item: tuple[Any, Any]) -> bool:
    """Stop watching ``item``; whether it was still watched (its end not yet written)."""
    with _PENDING_LOCK:
        for i, other in enumerate(_PENDING):
            if other is item:
                del _PENDING[i]
                return True
    return False


def _poll_once() -> int:
    """End every watched call whose device work has finished; how many are still running. The works are asked
    outside the lock: a query that blocks (a driver call behind a stuck stream) never holds up a thread that
    issues a call (``_watch``) or settles."""
    with _PENDING_LOCK:
        items = list(_PENDING)
    ready = [item for item in items if item[0].query()]
    if ready:
        with _PENDING_LOCK:  # only what is still pending: another poller may have ended some of them meanwhile
            still = {id(item) for item in _PENDING}
            ready = [item for item in ready if id(item) in still]
            taken = {id(item) for item in ready}
            _PENDING[:] = [item for item in _PENDING if id(item) not in taken]
        for _, done in ready:
            done()
    return len(items) - len(ready)


_STOPPING = threading.Event()


def _poll_events() -> None:
    while not _STOPPING.is_set():
        _poll_once()
        time.sleep(0.02)


def _stop_watcher(timeout: float = 1.0) -> None:
    """End the watcher thread between two polls (the next watched call starts another): no backend work is asked
    while its process group is torn down or the interpreter exits (a fresh clone's suite saw a gloo rank abort at
    exit, 'terminate called without an active exception', once in a run; not seen in 6 runs by hand)."""
    _STOPPING.set()
    for thread in list(_WATCHER):
        if thread is not threading.current_thread():
            thread.join(timeout)
    _STOPPING.clear()


def settle(wait: float = 0.0) -> int:
    """Read the end of every watched (device) call now, rather than at the watcher's next poll; with ``wait``,
    keep reading up to ``wait`` seconds while ledgers closed by their job still have calls running (an
    asynchronous gloo call ends through its work's future, on the backend's thread). Returns how many calls
    are still open then."""
    end = time.monotonic() + wait
    while True:
        left = _poll_once() + sum(len(led.open_calls()) for led in list(_CLOSING))
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.01)


def _drop_device_calls(note: str) -> None:
    """Stop watching the device calls still pending (a work is not asked again once its communicator is gone);
    they are written issued, with ``note``."""
    with _PENDING_LOCK:
        left = list(_PENDING)
        _PENDING.clear()
    for _, done in left:
        done(note)  # ``_end``: the recorder's own boundary says a fault


DESTROY_WAIT_S = 5.0
EXIT_WAIT_S = 2.0
EXIT_NOTE = "still running when the process exited: its end was never seen"


def _at_exit() -> None:
    """At interpreter exit (after the capture's own close, registered later): the last ends, then every call
    still open is written issued, so a job that exited never leaves a call that reads as running."""
    if _CLOSING:
        settle(EXIT_WAIT_S)
        for led in list(_CLOSING):
            led.abandon(EXIT_NOTE)
    if _WATCHER:
        _stop_watcher()


atexit.register(_at_exit)
_DESTROY: list[Any] = []
_BEFORE_DESTROY: list[Callable[[], Any]] = []  # run before the job's destroy_process_group takes its groups


def before_destroy(fn: Callable[[], Any]) -> Callable[[], None]:
    """Run ``fn`` when the job calls ``destroy_process_group``, while its groups still exist (a capture reads Flight
    Recorder's record of them there: after it, nothing of them can be read). Returns what takes ``fn`` off."""
    _watch_destroy()
    _BEFORE_DESTROY.append(fn)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _BEFORE_DESTROY.remove(fn)
        _unwatch_destroy()

    return remove


def _unwatch_destroy() -> None:
    """The job's own ``destroy_process_group`` back, once nothing is left for the wrapper to do (no reader before
    it, no ledger closed with calls still running, no device call watched)."""
    if not _DESTROY or _BEFORE_DESTROY or _CLOSING or _PENDING:
        return
    wrapper = dist.destroy_process_group
    if getattr(wrapper, "__wrapped__", None) is _DESTROY[0]:  # not one a later patch put over ours
        dist.destroy_process_group = _DESTROY.pop()


def _watch_destroy() -> None:
    """``destroy_process_group`` settles the calls it waited for (once per process; the wrapper only passes
    through when no ledger waits for an end)."""
    if _DESTROY:
        return
    original = dist.destroy_process_group
    _DESTROY.append(original)

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        # a boundary on the job's thread: its destroy goes on whatever the readers or the settling meet (the capture
        # says its readers' faults; a row's write fault is its ledger's fail())
        with contextlib.suppress(Exception):
            _before_destroying()
        if _WATCHER:
            _stop_watcher()
        return original(*args, **kwargs)

    dist.destroy_process_group = patch.unseen(destroy_process_group)



def _before_destroying() -> None:
    """The readers before destroy, then the calls it waited for settled and the device calls still pending written
    issued, whatever a reader or the settling raised (a reader that raises ends the readers' turn)."""
    try:
        for fn in list(_BEFORE_DESTROY):
            fn()
    finally:
        if _CLOSING or _PENDING:
            try:
                settle(DESTROY_WAIT_S)  # NCCL's shutdown waits for its pending work too: this adds no wait
            finally:
                _drop_device_calls("still running when its process group was destroyed: its end was never seen")


def is_plumbing(filename: str) -> bool:
    """A frame of the calls' own machinery between the user's line and the backend (skipped to find the caller)."""
    return filename.startswith(_PLUMBING)


def is_machinery(filename: str) -> bool:
    """A frame of the engine's own loop (ipyparallel, IPython, zmq...): below it nothing is the user's."""
    return bool(_MACHINERY.search(filename))


def add_plumbing(paths: Iterable[str]) -> Callable[[], None]:
    """Name more files as plumbing (a call's caller is the first frame outside them: a wrapper between the user's
    line and torch is not that line). Returns what takes them off again (the capture's close)."""
    global _PLUMBING
    added = tuple(p for p in dict.fromkeys(paths) if p not in _PLUMBING)
    _PLUMBING += added

    def remove() -> None:
        global _PLUMBING
        _PLUMBING = tuple(p for p in _PLUMBING if p not in added)

    return remove


P2P = ("send", "recv_", "isend", "irecv")


def backend_seq(pg: Any, device: torch.device | None = None) -> int:
    """How many calls the group's backend has numbered so far (Flight Recorder's ``collective_seq_id`` of its
    last one; ~0.3 us); 0 where the backend keeps no count."""
    if device is not None:  # a group of two backends (cpu:gloo,cuda:nccl) counts per backend
        try:
            return int(pg._get_backend(device)._get_sequence_number_for_group())
        except (RuntimeError, AttributeError, TypeError):  # no backend for that device, or one that keeps no count
            pass
    try:
        return int(pg._get_sequence_number_for_group())
    except (RuntimeError, AttributeError, TypeError):  # a backend that keeps no count (torch's private API)
        return 0


def _group(bound: dict[str, Any]) -> Any:
    """The call's process group: a c10d op's boxed ProcessGroup, a functional op's group name resolved."""
    for k, v in bound.items():
        if isinstance(v, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(v)
            except (RuntimeError, TypeError):  # a boxed object that is no process group
                continue
        if k == "group_name" and v is not None:
            if isinstance(v, dist.ProcessGroup):
                return v
            try:
                return dist.distributed_c10d._resolve_process_group(str(v))
            except (RuntimeError, ValueError):  # a name torch no longer registers
                return None
    return None


def _key(t: torch.Tensor) -> tuple:
    """A functional call's output as ``wait_tensor`` later receives it."""
    try:
        return (t.data_ptr(), t.numel(), str(t.dtype))
    except RuntimeError:  # a tensor without storage (a fake or wrapper subclass): by identity
        return (id(t),)


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _work_error(work: Any) -> BaseException | None:
    """The error a finished work ended with (a gloo recv that timed out), or None."""
    try:
        if work.is_success():
            return None
        exc = work.exception()
    except Exception as err:  # the work's own exception, of any class (the value sought, not our fault)
        return err
    return exc if isinstance(exc, BaseException) else RuntimeError(str(exc))


def _future_error(fut: Any) -> BaseException | None:
    try:
        fut.wait()
    except BaseException as exc:  # the future's own exception, of any class (the value sought, not our fault)
        return exc
    return None


def _is_timeout(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return "timed out" in msg or "timeout" in msg


def _frames() -> tuple[str, str, list[str], str]:
    """(first frame past the c10d plumbing, first frame in user code, a short stack, the library's line: the
    innermost frame of the library that issued the call, ``place``'s rule; empty when the user's code issued it).

    None is ever one of the workbench's own modes (poison's ``TorchFunctionMode``, the trace's hooks,
    this ledger): with poison on, every collective passes through ``poison.py``'s ``__torch_function__``.
    Nor the engine's machinery (``ipyparallel/engine/kernel.py do_apply``): the walk stops there. Code the
    user shipped is the user's whatever file it names (a script piped to ``python -`` names ``<stdin>``).
    """
    f = sys._getframe(2)
    walked: list[tuple[str, str, bool]] = []  # (file, "file:line function", the user's), innermost first
    while f is not None:
        fn = _filename(f)
        if not fn.startswith(_PLUMBING):
            if _MACHINERY.search(fn):
                break  # the kernel that ran the step: nothing past it issued this call
            mine = f.f_code.co_filename == _SHIPPED or not is_library(fn)
            walked.append((fn, f"{fn}:{f.f_lineno} {f.f_code.co_name}", mine))
            if mine:
                break
        f = f.f_back
    return place(walked)


def place(walked: list[tuple[str, str, bool]]) -> tuple[str, str, list[str], str]:
    """(caller, user's line, short stack, library's line) from the frames past the plumbing, innermost first,
    up to the user's (``(file, "file:line function", the user's)``); the ledger's and Flight Recorder's rule.

    The library's line is the innermost frame of the code that issued the call, beside the user's:
    - a third-party library that called torch.distributed itself (``accelerate/utils/fsdp_utils.py:522``), even
      through torch's own distributed code (accelerate's ``distribute_tensor``), but not one that only ran a
      module or autograd (transformers' layer ``__call__`` with FSDP2's hooks inside);
    - else torch's own distributed modules (FSDP's all-gather, DTensor's scatter, DDP's buffer broadcast in
      ``torch/nn/parallel``, the state-dict loaders, ``_sync_params_and_buffers``);
    - else autograd's engine, where C++ issued the call inside a backward (DDP's reducer, a comm hook).
    Torch's op plumbing (``torch/_library``'s autograd wrapper of functional collectives) is never one."""
    caller = walked[0][1] if walked else ""
    user = walked[-1][1] if walked and walked[-1][2] else ""
    stack = [where for _, where, _ in walked[:8]]
    third = torch_own = autograd = ""
    ran_module = False  # torch outside torch.distributed sits between: a module call or autograd, not a library's call
    for fn, where, mine in walked:
        if mine:
            break
        if fn.startswith(_TORCH_DIR):
            if fn.startswith(_TORCH_DISTRIBUTED_CODE):
                torch_own = torch_own or where
            elif fn.startswith(_AUTOGRAD):
                autograd = autograd or where
            if not fn.startswith(_TORCH_DISTRIBUTED):
                ran_module = True
        elif not third and not ran_module and _third_party(fn):
            third = where
    return caller, user, stack, third or torch_own or autograd


def _third_party(fn: str) -> bool:
    """An installed library other than torch and the workbench (accelerate, transformers, ...)."""
    return (("site-packages" in fn or "dist-packages" in fn) and not fn.startswith(_TORCH_DIR)
            and not fn.startswith(_WORKBENCH))


def _filename(f: Any) -> str:
    """The frame's file, the client's name for it where cloudpickle shipped the code by value.

    cloudpickle replaces ``co_filename`` with ``<dynamic-code>`` but keeps the line table and
    carries the defining module's ``__file__`` in the function's globals (a notebook cell has
    none: it stays ``<dynamic-code>``, still the user's code).
    """
    fn = f.f_code.co_filename
    if fn == _SHIPPED:
        origin = f.f_globals.get("__file__")
        return origin if isinstance(origin, str) and origin else fn
    return fn


def traceback_text(exc: BaseException) -> str:
    """``traceback.format_exc()`` with shipped code under its own file name (and so with its source lines)."""
    te = traceback.TracebackException.from_exception(exc)
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if len(frames) == len(te.stack):
        for summary, frame in zip(te.stack, frames):
            summary.filename = _filename(frame)
    return "".join(te.format())


def is_library(fn: str) -> bool:
    """Not the user's code: an installed package, the standard library, the workbench's instruments and lab,
    code without a file; the user's shipped code and the catalogue's scenarios are the user's."""
    if fn.startswith(_USER_PREFIXES):
        return False
    return ("site-packages" in fn or "dist-packages" in fn or fn.startswith((_HERE, _LAB))
            or (bool(_STDLIB) and fn.startswith(_STDLIB)) or fn.startswith("<"))


_ACTIVE: list[_Recorder] = []


def _coalesced_wrapper(original):
    def _broadcast_coalesced(process_group, tensors, buffer_size, src=0):
        rec = _ACTIVE[-1] if _ACTIVE else None
        if rec is None:
            return original(process_group, tensors, buffer_size, src)
        rec.coalesced.append({"tensors": [(t.dtype, t.numel()) for t in tensors], "buckets": 0})
        try:
            agree.synced(tensors, dist.get_process_group_ranks(process_group), "broadcast")
        except Exception:  # a boundary on the job's thread: never fail its call for the sake of an expectation
            pass
        try:
            return original(process_group, tensors, buffer_size, src)
        finally:
            rec.coalesced.pop()
    _broadcast_coalesced.__wrapped__ = original
    return patch.unseen(_broadcast_coalesced)


@contextlib.contextmanager
def recording(ledger: Ledger, step: str = "") -> Iterator[Ledger]:
    """Record every collective this thread issues inside the block into ``ledger`` (and make the subgroups it
    forms releasable)."""
    stop = start_recording(ledger, step)
    try:
        yield ledger
    finally:
        stop()


class _Off:
    off = True  # a recorder over this passes every op through


_PREPARED: list[bool] = []


def prepare() -> None:
    """Take now, while torch is still torch's, every first use the recorder would otherwise take inside the job's
    first collective: its mode's ``__torch_dispatch__`` is wrapped in ``torch._disable_dynamo``, whose first call
    imports ``torch._dynamo``, and that import checks its polyfills' signatures against torch's own functions.
    A stack that patched torch before that call fails it: DeepSpeed's ``zero.Init`` replaces
    ``torch.Tensor.__new__``, and the broadcast inside it then raised ``TypeError: Signature mismatch between
    get_new_tensor_fn_for_dtype.<locals>.new_tensor and tensor_pynew`` into the job (both ledger modes). One op
    through an idle recorder here imports it and caches the wrapper (once per process; the import is paid here
    rather than at the first collective)."""
    if _PREPARED:
        return
    before = set(sys.modules)
    import torch._dynamo  # what ``_disable_dynamo`` imports at its first call

    with _Recorder(_Off()):  # type: ignore[arg-type]
        torch.ops.aten.empty.memory_format([0])
    _PREPARED.append(True)
    _unpin_world(set(sys.modules) - before)


def _unpin_world(modules: Iterable[str]) -> None:
    """Where ``prepare``'s import ran after the job's ``init_process_group`` (a capture opened after it), the modules
    it imported that take ``group=group.WORLD`` as a default evaluated at import (``torch.distributed.nn.functional``,
    ``torch.distributed._shard``'s ops) hold the job's world group for good: its ``destroy_process_group`` then frees
    nothing, gloo's workers live into interpreter exit, and one that drops a finished work there aborts the process
    (``tests/test_close_leaves_torch.py`` says how). Those defaults become None, what they are when torch is imported
    before the group (the common order), and what ``group=None`` means: the default group."""
    world = dist.distributed_c10d._world.default_pg if dist.is_available() and dist.is_initialized() else None
    if world is None:
        return
    for name in modules:
        module = sys.modules.get(name)
        # plain functions only, read from the dicts: never an attribute lookup (a lazy module imports on one)
        for value in list(vars(module).values()) if isinstance(module, types.ModuleType) else ():
            for fn in _functions(value):
                if fn.__defaults__ and any(d is world for d in fn.__defaults__):
                    fn.__defaults__ = tuple(None if d is world else d for d in fn.__defaults__)
                if fn.__kwdefaults__ and any(v is world for v in fn.__kwdefaults__.values()):
                    fn.__kwdefaults__ = {k: None if v is world else v for k, v in fn.__kwdefaults__.items()}


def _functions(value: Any) -> list[types.FunctionType]:
    """A module attribute's Python functions: itself, or a class's own methods (static and class ones unwrapped)."""
    if isinstance(value, types.FunctionType):
        return [value]
    if not isinstance(value, type):
        return []
    out = []
    for member in list(vars(value).values()):
        member = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if isinstance(member, types.FunctionType):
            out.append(member)
    return out


def start_recording(ledger: Ledger, step: str = "") -> Any:
    """``recording`` without a block (a capture's, on until it closes): returns the function that stops it.
    Its mode leaves the dispatch stack only from the top; where the job pushed a mode of its own above it since,
    the recorder stays below, off (it passes every call through)."""
    prepare()
    ledger.step = step
    recorder = _Recorder(ledger)
    c10d = dist.distributed_c10d
    original = dist._broadcast_coalesced
    # A live engine tracks every subgroup for good (``control.track_new_groups``); elsewhere (a job's capture) the
    # ones formed while recording are tracked, and c10d is left as it was found at the stop.
    original_new = None if control.tracks_new_groups() else getattr(c10d, "_new_group_with_tag", None)
    dist._broadcast_coalesced = _coalesced_wrapper(original)
    if original_new is not None:
        c10d._new_group_with_tag = control.group_tracker(original_new)
    _ACTIVE.append(recorder)
    recorder.__enter__()

    def stop() -> None:
        try:
            if not leave_mode(recorder, dispatch=True):
                ledger.off = True
            recorder.finish()
        finally:
            if recorder in _ACTIVE:
                _ACTIVE.remove(recorder)
            dist._broadcast_coalesced = original
            if original_new is not None:
                c10d._new_group_with_tag = original_new

    return stop


def leave_mode(mode: Any, dispatch: bool) -> bool:
    """Pop ``mode`` (a dispatch or function mode this code pushed) where it is the top of its stack; False where
    another mode sits above it (a mode leaves a stack only from its top)."""
    n = torch._C._len_torch_dispatch_stack() if dispatch else torch._C._len_torch_function_stack()
    top = (torch._C._get_dispatch_stack_at(n - 1) if dispatch else torch._C._get_function_stack_at(n - 1)) \
        if n else None
    if top is not mode:
        return False
    mode.__exit__(None, None, None)
    return True


_LEDGERS: dict[str, Ledger] = {}


def open_ledger(session: str, directory: str | None, rank: int, attempt: int = 0) -> Ledger | None:
    """The session's ledger on this rank (None when the client asked for no ledger)."""
    close_ledger(session)
    if not directory:
        return None
    _LEDGERS[session] = Ledger(directory, rank, session, attempt)
    return _LEDGERS[session]


def get_ledger(session: str) -> Ledger | None:
    return _LEDGERS.get(session)


def close_ledger(session: str) -> None:
    old = _LEDGERS.pop(session, None)
    if old is not None:
        old.close()


def flight_recorder() -> list[dict[str, Any]]:
    """This rank's Flight Recorder entries (a cross-check; needs the rank to answer)."""
    try:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False)
    except (RuntimeError, AttributeError) as exc:  # no record on this backend, or a torch without the function
        return [{"error": f"{type(exc).__name__}: {exc}"}]
    entries = json.loads(raw).get("entries", [])
    keep = ("profiling_name", "collective_seq_id", "p2p_seq_id", "process_group", "input_sizes", "input_dtypes",
            "output_sizes", "output_dtypes", "state", "retired")
    return [{k: e.get(k) for k in keep} for e in entries]
