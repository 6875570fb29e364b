"""Post mortem: every rank of the job attachable after one rank raises, or once the ledgers prove a deadlock.

    cap = wj.capture("runs/train", attach="on-error")      # or "on-deadlock", or "post-mortem" (both)

An exception that would end a rank (``sys.excepthook``; or ``cap.post_mortem(exc)`` in an ``except``)
first serves that rank as an ipyparallel engine on its main thread (its namespace: the exception as
``exc``, the failing frame's locals, the last point's objects, ``cap``), and sets a key in the job's own
store. Every rank runs one daemon thread (``workbench-postmortem``) that polls that store; the ranks
that did not raise are stuck in a collective on their main thread (gloo and NCCL wait with the GIL
released), so their thread serves them instead, with the locals of the main thread's innermost frame
of the job's own code. ``wb.connect(job=dir)`` attaches as at a breakpoint; ``engine.json`` says
which rank raised, where (file, line, function) and where each other rank waits (its open calls from
its own ledger, its main thread's line). Nothing here issues a collective: the trigger, the engine
file and the "all done" marks go through the store. The raising rank prints its traceback before it
serves (the whole chain of excepthooks, ``capture_attach.Attach._tell``: what the job would have printed, at once
and once), and the rank whose error starts the post mortem says in one line (``wait_line``) that every
rank waits for a notebook, for how long, how to attach and how to end the wait now (Ctrl-C: the launcher
passes it to every rank; the serving rank's ``KeyboardInterrupt`` ends its wait). ``cluster.resume()`` (or
the deadline) ends the serving: the raising rank's excepthook returns (the process exits 1), so the job
fails exactly as it would have and the launcher ends the others. A cell
that holds the raising rank past the deadline inside a call it cannot leave (a collective the stuck
ranks never join) does not keep it: the rank prints its traceback and exits 1 there.

``on-deadlock``: each rank's thread follows its own ledger file (the lines since its last read); a
call open past ``hang_after`` seconds is published in the store; rank 0's thread reads them, and once
every rank waits in a call that is not the same collective (another group, another op, another
sequence number or shape) the deadlock is proven: the calls go to ``engine.json`` as the proof and
every rank serves from its thread. Once the attach is over (resumed, or the deadline) the job ends at
once, each rank in one line and exit status 1, rather than at its group's timeout. A rank that waits
while another issues no call at all is not a proof (that one may be computing) and attaches nothing.

On NCCL a waiting rank's GPU is held: its stream waits behind kernels of a collective that never
completes, so nothing the notebook runs there would return. Once a waiting rank's part of the account
is in the store, its watcher frees it (``_release``): the main thread is told to stop at its next line
of Python (``sys.monitoring``, Python 3.12), the job's communicators are aborted (as the live session's
release does), the kernels end and the stream drains, so the probe reads the device; calls that end
only at the abort are written failed ("aborted by the workbench"), never completed. A rank whose device
still cannot be read answers ``cluster.probe`` with its last point's rows, labelled (``as_of``). After
the attach a released rank ends in one line, exit status 1 (``Capture._excepthook``).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

from workbench.job import config, engine, guest, keys
from workbench.rank import waitfor

MODES = {"on-error": ("error",), "on-deadlock": ("deadlock",), "post-mortem": ("error", "deadlock"),
         True: ("error", "deadlock")}
ABORT_WAIT_S = 5.0  # how long a waiting rank gives the abort of its communicators before it serves without
END_JOIN_S = 10.0  # how long close waits for the watcher's store call in flight (~ms; seconds under load)
END_WAIT_S = 2.0  # after a deadlock's attach: how long a released main thread has to end the rank itself
STORE_LOST_AFTER = 3  # consecutive polls the job's store fails before the watcher calls it lost (a blip passes)


class Released(BaseException):
    """Raised on a waiting rank's main thread when the post mortem freed its stuck NCCL call (the job's
    communicators aborted once the account was taken): the rank stops there, waits until the notebook is done
    and ends with exit status 1 (``shard.Capture._excepthook``). A ``BaseException``, so the job's own handlers
    of ``Exception`` do not take it for one of its errors."""


class Role(enum.Enum):
    """Where this rank stands in the post mortem (string values: what a rank publishes of itself reads the same)."""

    RAISED = "raised"  # its main thread serves, for its own error
    WAITING = "waiting"  # its watcher thread serves, for another rank's error or a deadlock
    SERVED = "served"  # its serving is over (or there was none to be had)


STORE_ERRORS = (RuntimeError, OSError)  # what a store's call raises: DistStoreError/DistError, a socket's error


class StoreDown(RuntimeError):
    """The job's store failed a call (a dead ``TCPStore``'s client: connection refused, reset): not a key that is
    absent. The watcher counts these and, once they persist, says so and stops."""

    def __init__(self, exc: BaseException):
        super().__init__(guest.cause(exc))
        self.cause = exc


@dataclass
class Watch:
    """A capture's post-mortem watch (``Capture.watch``): what triggers it, its windows, its thread, and where this
    rank stands in the post mortem."""

    triggers: tuple[str, ...]  # "error", "deadlock"
    deadline: float  # how long the ranks serve
    hang_after: float  # how long a call waits before the ledgers may call it stuck
    device: Any = None  # the main thread's CUDA device at install (a point records it again as it goes)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    role: Role | None = None  # RAISED | WAITING while this rank serves; SERVED after (set only by ``take``)
    released: dict[str, Any] | None = None  # what ``_release`` freed: rank, call, held, groups, abort_s
    device_held: str | None = None  # why the abort of its communicators failed (its device stays held)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the role: its thread and its main thread
    served: threading.Event = field(default_factory=threading.Event)  # set once the role is SERVED
    said: set[str] = field(default_factory=set)  # the faults said already (``say_once``)

    def take(self, role: Role) -> Role | None:
        """Become ``role`` unless this rank stands somewhere already; SERVED is always taken (the end of any
        serving) and wakes whoever waits for it. Returns the role it had before (None: it is ``role`` now). The
        one place the role is set: the main thread (its error) and the watcher (another's) race for it."""
        with self.lock:
            before = self.role
            if before is None or role is Role.SERVED:
                self.role = role
                if role is Role.SERVED:
                    self.served.set()
            return before

    def say_once(self, what: str, line: str) -> None:
        """One line on stderr (``guest.say``) for a fault of kind ``what``, once per watch however often it recurs."""
        with self.lock:
            if what in self.said:
                return
            self.said.add(what)
        guest.say(line)

    def end(self, wait: float = END_JOIN_S) -> None:
        """Stop the polling watcher thread and wait up to ``wait`` seconds for a store call it is in: a daemon
        thread still inside a C++ call when the interpreter finalizes is ended mid-call and the rank aborts
        ('terminate called without an active exception', exit status 1 on a clean job)."""
        self.stop.set()
        thread = self.thread
        if thread is None or thread is threading.current_thread() or self.role is not None:
            return  # a thread that serves a post mortem ends with it (its deadline, the notebook, Ctrl-C)
        thread.join(wait)


class Watched(engine.Host, Protocol):
    """What the watch reads of its capture (``shard.Capture``) beyond what an attach reads."""

    watch: Watch | None

    @property
    def closed(self) -> bool: ...

    @property
    def ledger_path(self) -> str | None: ...  # this rank's ledger file, None without a ledger

    @property
    def job_excepthook(self) -> Any: ...  # the excepthook the capture took over (the job's failure as it was)

    def open_calls(self) -> list[dict[str, Any]]: ...

    def watch_flight_recorder(self, still_for: float) -> int: ...


def modes(attach: Any) -> tuple[str, ...]:
    """``capture(attach=...)`` as the set of triggers; one clear line for anything else."""
    if attach in (None, False, "", "off"):
        return ()
    if attach not in MODES:
        raise ValueError(f"attach must be 'on-error', 'on-deadlock' or 'post-mortem' (both); got {attach!r}")
    return MODES[attach]


def install(cap: Watched, triggers: tuple[str, ...], deadline: float, hang_after: float,
            poll: float | None = None) -> Watch | None:
    """Start this rank's watcher thread (once per capture); returns its ``Watch`` for the capture to hold (None
    without triggers). It asks the store one key every ``poll`` seconds: 0.5 s, longer from 128 ranks on (every
    rank asks the one store: 2 requests a second per rank at 0.5 s)."""
    if not triggers:
        return None
    poll = poll if poll is not None else max(0.5, cap.world_size / 256)
    watch = Watch(triggers, float(deadline), float(hang_after), device=_main_device())
    watch.thread = threading.Thread(target=_watch, args=(cap, watch, poll), name="workbench-postmortem",
                                    daemon=True)
    watch.thread.start()
    return watch


def _main_device() -> Any:
    """The main thread's CUDA device when it has one already (a point records it again as it goes)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _key(cap: engine.Host) -> keys.Attach:
    return keys.post_mortem(cap.attempt)


def _has(store: Any, key: str) -> bool:
    """Whether ``key`` is in the store (False: absent); a store that fails the call raises ``StoreDown``."""
    try:
        return bool(store.check([key]))
    except STORE_ERRORS as exc:
        raise StoreDown(exc) from exc


def _get(store: Any, key: str) -> Any:
    """``key``'s JSON value; None where the key is absent (the store's get waits for one until its timeout: ask
    ``_has`` first) or its value is not JSON. A store that fails the call raises ``StoreDown``."""
    try:
        raw = store.get(key)
    except STORE_ERRORS as exc:
        if not _has(store, key):  # the get timed out on an absent key (``_has`` raises for a store that is down)
            return None
        raise StoreDown(exc) from exc
    try:
        return json.loads(raw.decode())
    except (ValueError, AttributeError):
        return None


def _set(store: Any, key: str, value: str) -> None:
    """``store.set``; a store that fails the call raises ``StoreDown``."""
    try:
        store.set(key, value)
    except STORE_ERRORS as exc:
        raise StoreDown(exc) from exc


def _claim(store: Any, key: keys.Attach, trigger: dict[str, Any]) -> bool:
    """Whether this rank is the first to claim the post mortem (then its trigger is published); a store that fails
    the call raises ``StoreDown``."""
    try:
        first = store.add(key.claim, 1) == 1
    except STORE_ERRORS as exc:
        raise StoreDown(exc) from exc
    if first:
        _set(store, key.go, json.dumps(trigger, default=str))
    return first


def _peek(store: Any, key: str) -> Any:
    """``key``'s value if it is there, None otherwise or where the store fails (serving: the account goes on)."""
    try:
        return _get(store, key) if _has(store, key) else None
    except StoreDown:
        return None


def _there(store: Any, key: str) -> bool:
    try:
        return _has(store, key)
    except StoreDown:
        return False


# -- the rank that raised ------------------------------------------------------------------------
def may_wait(watch: Watch | None, exc: BaseException) -> bool:
    """Whether ``exc`` may make this rank wait for a notebook (``on_exception``): its traceback is printed first."""
    return (watch is not None and "error" in watch.triggers
            and not isinstance(exc, (KeyboardInterrupt, SystemExit, Released)))


def on_exception(cap: Watched, watch: Watch | None, exc: BaseException, tb: Any,
                 told: bool = False) -> dict[str, Any] | None:
    """Serve this rank (and have every rank serve) for ``exc``; returns how it ended, None when it did not
    serve (post mortem off, already served in this job, a KeyboardInterrupt or SystemExit). ``told``: its
    traceback is printed already (the excepthook's, before the wait): a rank that fails later does not print it
    again. The rank whose error starts the post mortem says, in one line, that every rank waits for a notebook,
    for how long, how to attach and how to end the wait now (``wait_line``)."""
    if not may_wait(watch, exc):
        return None
    had = watch.take(Role.RAISED)
    if had is not None:  # this rank serves already (its thread, for another rank's error) or did
        if had is not Role.SERVED:  # wait for that attach to end, then fail as the job would have
            watch.served.wait()
        return None
    store = engine.job_store()  # where another rank raised first, this one serves too, as a rank that raised
    if store is None and cap.world_size > 1:  # no process group (not yet, or destroyed): no way to the others
        sys.__stderr__.write("workbench: no post-mortem attach: the job's process group is not initialized, so "
                             "the other ranks cannot be told\n")
        watch.take(Role.SERVED)
        return None
    key = _key(cap)
    error = _error(exc, tb)
    trigger = {"reason": "error", "rank": cap.rank, "error": f"{error['type']}: {error['message']}"[:300],
               "where": error["where"], "t": time.time()}
    frame = _failing_frame(tb)
    objects = dict(frame.f_locals) if frame is not None else {}
    objects.update(exc=exc, tb=tb, frame=frame)
    me = {"rank": cap.rank, "role": Role.RAISED.value, "error": error, "where": error["where"],
          "open_calls": _open_calls(cap)}
    first = store is None
    if store is not None:
        try:
            _set(store, key.rank(cap.rank), json.dumps(me, default=str))
            first = _claim(store, key, trigger)
        except StoreDown as exc:
            _not_started(cap, watch, exc.cause)
    if first:
        guest.say(wait_line(cap, watch, f"rank {cap.rank} raised {trigger['error'].splitlines()[0][:200]}"))
    return _serve(cap, watch, objects, trigger if store is None else None,
                  on_stuck=lambda: _fail_now(cap, exc, tb, told))


def _not_started(cap: engine.Host, watch: Watch, exc: BaseException) -> None:
    """The trigger could not be published in the job's store: the other ranks never learn of it, so the post
    mortem does not start from this rank. Said once; the job goes on as it would have."""
    watch.say_once("publish", f"workbench: rank {cap.rank}: the post mortem could not be started: the job's store "
                              f"did not take its trigger ({guest.cause(exc)}); the job goes on as it would have")


ENV_LAUNCHER = config.ENV_LAUNCHER  # the launcher's pid (``workbench job`` execs it: its own pid)


def wait_line(cap: engine.Host, watch: Watch, what: str, then: str = "the job then fails as it would have") -> str:
    """The one line a job says when it starts to wait for a notebook: what happened, that every rank is
    attachable, for how long, how to attach, and how to end the wait now (Ctrl-C at the launcher's terminal: the
    launcher passes it on to every rank; or a signal to the launcher from elsewhere)."""
    pid = config.from_env().launcher_pid
    kill = f" or `kill {pid}`" if pid is not None else ""
    return (f"workbench: {what}; every rank ({cap.world_size}) is attachable from a notebook for "
            f"{watch.deadline:g} s: wb.connect(job={os.path.abspath(cap.root)!r}); end the wait now with Ctrl-C{kill} "
            f"(or cluster.resume()): {then}")


def _fail_now(cap: Watched, exc: BaseException, tb: Any, told: bool = False) -> None:
    """A notebook's cell holds the raising rank past the deadline inside a call it cannot leave: the rank fails
    now, as it would have without the workbench (its traceback, unless printed before the wait; exit status 1)."""
    with contextlib.suppress(BaseException):  # broad: nothing (a hook's own error, an interrupt) may skip the exit
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not the engine's streams to the notebook
        if not told:
            hook = cap.job_excepthook or sys.__excepthook__
            hook(type(exc), exc, tb)
        sys.__stderr__.flush()
    os._exit(1)


def _error(exc: BaseException, tb: Any) -> dict[str, Any]:
    frame = _failing_frame(tb)
    where = _where(frame, tb_line(tb, frame)) if frame is not None else "?"
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "where": where,
            "traceback": "".join(traceback.format_exception(type(exc), exc, tb))[-6000:]}


def tb_line(tb: Any, frame: Any) -> int | None:
    """The line ``frame`` was at when the exception passed it."""
    line = None
    while tb is not None:
        if tb.tb_frame is frame:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


_WORKBENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user(filename: str) -> bool:
    """The job's own code: what the ledger counts as a library (the standard library, an installed package,
    code without a file) is not, and no frame of the workbench is."""
    from workbench.rank.ledger import is_library

    f = os.path.abspath(filename) if not filename.startswith("<") else filename
    return not is_library(f) and not f.startswith(_WORKBENCH)


def _failing_frame(tb: Any) -> Any:
    """The innermost frame of the job's own code in the traceback (else the innermost frame)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for f in reversed(frames):
        if _user(f.f_code.co_filename):
            return f
    return frames[-1] if frames else None


def _where(frame: Any, line: int | None = None) -> str:
    """``file:line in function``, the file relative to the job's working directory where it lies below it."""
    code = frame.f_code
    name = code.co_filename
    if not name.startswith("<"):
        rel = os.path.relpath(name)
        name = name if rel.startswith("..") else rel
    return f"{name}:{line or frame.f_lineno} in {code.co_name}"


def _open_calls(cap: Watched) -> list[dict[str, Any]]:
    """This rank's open calls for the account; none where its ledger cannot be read (the account goes on)."""
    with contextlib.suppress(OSError, ValueError, RuntimeError):  # the ledger file, its lines, torch's counters
        return cap.open_calls()
    return []


# -- the ranks that wait ---------------------------------------------------------------------------
def _main_frame() -> Any:
    """The innermost frame of the job's own code on the main thread (where it waits)."""
    f = sys._current_frames().get(threading.main_thread().ident)
    while f is not None and not _user(f.f_code.co_filename):
        f = f.f_back
    return f


def _watch(cap: Watched, watch: Watch, poll: float) -> None:
    try:
        _watch_loop(cap, watch, poll)
    except Exception as exc:  # broad: the thread's top; one line, never a thread's traceback in the job's log
        watch.say_once("watcher", f"workbench: rank {cap.rank}'s post-mortem watcher stopped: {guest.cause(exc)}")


def _watch_loop(cap: Watched, watch: Watch, poll: float) -> None:
    """Poll the job's store until a post mortem starts (this rank then serves), the capture closes, or the store
    stays down ``STORE_LOST_AFTER`` polls in a row (said once; post mortem off on this rank)."""
    key = _key(cap)
    tail = ledger_reader(cap.ledger_path) if "deadlock" in watch.triggers else None
    state: dict[str, Any] = {"published": None}
    store = None
    down = 0  # consecutive polls the store failed
    while not watch.stop.wait(poll):
        if cap.closed:
            return
        if store is None:
            with contextlib.suppress(RuntimeError, ValueError):  # the group torn down meanwhile: asked again next poll
                store = engine.job_store()
            if store is None:
                continue
        try:
            if _poll(cap, watch, store, key, tail, state):
                return
        except StoreDown as exc:
            down += 1
            if down >= STORE_LOST_AFTER:
                _store_lost(cap, exc)
                return
            continue
        down = 0


def _store_lost(cap: Watched, exc: StoreDown) -> None:
    """The job's store stays down: one line, unless the job has no process group any more (it destroyed its
    groups: no post mortem is left to lose, and a store gone with them is no fault)."""
    gone = False
    with contextlib.suppress(RuntimeError, ValueError):  # the group half torn down: not gone, say it
        gone = engine.job_store() is None
    if not gone:
        guest.say(f"workbench: rank {cap.rank}'s post-mortem watcher lost the job's store: {exc}; post mortem off "
                  "on this rank")


def _poll(cap: Watched, watch: Watch, store: Any, key: keys.Attach, tail: Any, state: dict[str, Any]) -> bool:
    """One poll of the store; True once the watcher is done (it served, or its rank serves already). A store that
    fails raises ``StoreDown``."""
    if _has(store, key.go):
        trigger = _get(store, key.go) or {}
        if watch.take(Role.WAITING) is not None:
            return True  # this rank raised (its main thread serves) or served already
        frame = _main_frame()
        objects = dict(frame.f_locals) if frame is not None else {}
        objects["frame"] = frame
        me = {"rank": cap.rank, "role": Role.WAITING.value, "where": _where(frame) if frame is not None else "?",
              "open_calls": _open_calls(cap)}
        with contextlib.suppress(StoreDown):  # the account then says "?" for this rank; it serves all the same
            _set(store, key.rank(cap.rank), json.dumps(me, default=str))
        del frame
        _release(cap, watch, me)  # its part of the account is taken: free its stream so its device reads
        _off_the_stuck_stream(cap, watch)
        served = _serve(cap, watch, objects, None, trigger=trigger)
        if trigger.get("reason") == "deadlock" and served.get("by") in ("client", "deadline"):
            _end_after_deadlock(cap, watch, trigger, store, key)
        return True
    if tail is None:
        return False
    # a call only Flight Recorder saw (DDP's reducer) may be the one; its fill says its own faults (``_takes``),
    # what is left is torch's counters of a group torn down meanwhile: read again next poll
    with contextlib.suppress(RuntimeError, AttributeError, ValueError):
        cap.watch_flight_recorder(min(1.0, watch.hang_after / 2))
    now = time.time()
    calls = open_calls(tail)
    old = [c for c in calls if now - float(c.get("t") or now) > watch.hang_after]
    mine = json.dumps(old[:4], default=str) if old else "[]"
    if mine != state["published"]:
        _set(store, key.open(cap.rank), mine)  # a store that fails: the watcher counts it (``StoreDown``)
        state["published"] = mine
    if cap.rank == 0 and old:
        proof = _prove(store, key, cap.world_size)
        if proof is not None:
            try:
                first = _claim(store, key, {"reason": "deadlock", "rank": None, "proof": proof, "t": time.time()})
            except StoreDown as exc:
                _not_started(cap, watch, exc.cause)
                return False
            if first:
                guest.say(wait_line(cap, watch, f"the ledgers proved a deadlock: {proof['line']}",
                                    "every rank then ends, exit status 1"))
    return False


def _nccl() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_initialized() and "nccl" in str(dist.get_backend())
    except (RuntimeError, ValueError, AttributeError):  # a group torn down meanwhile, a torch without the call
        return False


def _release(cap: Watched, watch: Watch, me: dict[str, Any]) -> dict[str, Any] | None:
    """On NCCL, free this waiting rank: its main thread is held behind kernels that wait for a collective that
    can never complete (so is its GPU: nothing the notebook runs there would return). The main thread is told
    to stop at its next line of Python (``Released``), then the job's communicators are aborted, as the live
    session's release does (``control.abort_groups``): the kernels end, the stream drains, the main thread
    stops in the capture's excepthook until the attach is over. The account holds this rank's open calls from
    before. Gloo needs none of it (its waits hold no device)."""
    if not _nccl():
        return None
    from torch.distributed import distributed_c10d as c10d

    from workbench.rank import control

    t0 = time.perf_counter()
    calls = me.get("open_calls") or []
    watch.released = {"rank": cap.rank, "call": f"{calls[0].get('op')} #{calls[0].get('seq')}" if calls
                      else None, "held": _hold_main_thread(watch)}
    control.mark()
    box: dict[str, Any] = {}
    done = threading.Event()

    def abort() -> None:
        try:
            groups = sorted(c10d._world.pg_names, key=lambda g: c10d._world.pg_names[g], reverse=True)
            box["n"] = control.abort_groups(groups, c10d._get_default_group())
        except Exception as exc:  # broad: the abort thread's top; its caller says it (device held) and serves on
            box["exc"] = exc
        finally:
            done.set()

    # on its own thread, bounded: an abort seen blocking for good (4 x H200, NCCL 2.28: a rank whose main thread
    # waited in a synchronous copy behind a call of the world group, with a second NCCL group beside it) must not
    # keep the rank from serving
    threading.Thread(target=abort, name="workbench-abort", daemon=True).start()
    if not done.wait(ABORT_WAIT_S) or "exc" in box:
        why = (f"{type(box['exc']).__name__}: {box['exc']}" if "exc" in box
               else f"the abort did not return in {ABORT_WAIT_S:g} s")
        watch.device_held = why  # its probe answers with its last point's rows, without asking the device
        guest.say(f"workbench: rank {cap.rank}: the post mortem could not free its communicators ({why}); its "
                  "device stays held")
        return watch.released
    watch.released.update(groups=box["n"], abort_s=time.perf_counter() - t0)
    return watch.released


def _hold_main_thread(watch: Watch) -> bool:
    """Stop the main thread at its next line of Python once the abort frees it (Python 3.12's ``sys.monitoring``;
    an asynchronous exception could land inside the excepthook of an error the abort raised): it waits there
    until the attach is over, then raises ``Released``, so no more of the job's code runs on a rank whose
    communicators are gone. Without ``sys.monitoring`` (Python 3.11) the main thread runs on until the job's
    next collective raises, and its excepthook waits the same way. Lines of the workbench's own code pass."""
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        return False
    tool = next((i for i in range(6) if mon.get_tool(i) is None), None)
    if tool is None:  # every tool id taken (debuggers, profilers, coverage)
        return False
    mon.use_tool_id(tool, "workbench-postmortem")
    main = threading.main_thread()

    def on_line(code: Any, line: int) -> Any:
        if threading.current_thread() is not main:
            return None if _user(code.co_filename) else mon.DISABLE  # the serving thread runs at full speed
        if code.co_filename.startswith(_WORKBENCH):
            return None
        mon.set_events(tool, 0)
        watch.served.wait()
        with contextlib.suppress(ValueError):  # the tool id freed already (another thread's release)
            mon.register_callback(tool, mon.events.LINE, None)
            mon.free_tool_id(tool)
        raise Released()

    mon.register_callback(tool, mon.events.LINE, on_line)
    mon.set_events(tool, mon.events.LINE)
    return True


def was_released(watch: Watch | None) -> bool:
    """Whether the post mortem aborted this rank's communicators (its main thread's next error is ours)."""
    return watch is not None and bool(watch.released)


def released_line(rank: int, watch: Watch | None, exc: BaseException) -> str:
    """What a released rank says when it ends (its excepthook), one line."""
    got = (watch.released if watch is not None else None) or {}
    call = f" from {got['call']}" if got.get("call") else ""
    after = "" if isinstance(exc, Released) else f" ({type(exc).__name__} on the aborted communicators)"
    return (f"workbench: rank {rank} was released{call} by the post mortem (its "
            f"communicators aborted once the account was taken){after}; it ends here with exit status 1\n")


def _end_after_deadlock(cap: Watched, watch: Watch, trigger: dict[str, Any], store: Any, key: keys.Attach) -> None:
    """After a deadlock's attach (the notebook resumed, or the deadline), the job ends now rather than at its
    group's timeout: once rank 0 has closed the attach (no rank leaves while another still serves: the launcher
    would end it), a released main thread ends the rank itself (its excepthook); one still stuck in its call
    (gloo: its socket waits are not aborted) ends with the rank here, exit status 1, in one line."""
    if cap.rank != 0:
        with contextlib.suppress(*STORE_ERRORS):  # not closed in time, or the store gone with rank 0: end all the same
            import datetime

            store.wait([key.closed], datetime.timedelta(seconds=keys.CLOSED_AFTER_DEADLOCK_S))
    end = time.monotonic() + (END_WAIT_S if watch.released else 0.0)
    while time.monotonic() < end:
        time.sleep(0.05)
    line = (f"workbench: rank {cap.rank} ends now (exit status 1): the ledgers proved a deadlock "
            f"({(trigger.get('proof') or {}).get('line', '?')}) and the post mortem is over; its call could "
            "never complete\n")
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no stdout, or closed: the line goes all the same
        sys.__stdout__.flush()
    guest.say(line)
    os._exit(1)


def _off_the_stuck_stream(cap: Watched, watch: Watch) -> None:
    """Serve on the main thread's GPU with a stream of this thread's own. On NCCL a rank that waits in a
    collective has its default stream queued behind kernels that wait for that collective, so whatever the
    notebook runs there (the probe's copies, a ``.cpu()``) would wait for ever; and CUDA's current device and
    PyTorch's current stream are per thread (a new thread starts on device 0, default stream)."""
    torch = sys.modules.get("torch")
    if watch.device_held:  # a CUDA call here could wait behind the abort that never returned
        return
    dev = cap.device
    if getattr(dev, "type", "") != "cuda":
        dev = watch.device
    if torch is None or dev is None or not torch.cuda.is_available():
        return
    try:
        from workbench.rank import probe

        torch.cuda.set_device(dev)
        stream = torch.cuda.Stream(dev)  # a pool stream: CUDA's non-blocking kind
        torch.cuda.set_stream(stream)
        probe.read_by_host_copies(stream)  # no device allocation: the stuck main thread holds the context
    except (RuntimeError, AttributeError, TypeError, ValueError) as exc:  # CUDA's errors, a torch without the call
        guest.say(f"workbench: rank {cap.rank} serves on the default stream ({guest.cause(exc)})")


KEEP = ("rank", "group", "group_ranks", "seq", "op", "dtypes", "shapes", "numel", "bytes", "src", "send", "recv",
        "user_frame", "t", "step", "attempt")  # what a rank publishes of a call: enough to pair it (mismatch_kind)


def open_calls(reader: Any) -> list[dict[str, Any]]:
    """The calls a ledger reader (``open_only``) holds open after reading what was appended, oldest first."""
    reader.poll()
    calls = [{k: c.get(k) for k in KEEP} for c in reader.calls()]
    return sorted(calls, key=lambda c: float(c.get("t") or 0))


def ledger_reader(path: str | None) -> Any:
    """This rank's own ledger file followed line by line, keeping only the calls still open."""
    from workbench.rank.ledger_read import LedgerReader

    return LedgerReader([path] if path else [], open_only=True)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """One collective seen from two ranks: the same group's same call that pairs, by the analysis' own rule
    (``mismatch_kind``: what travels between the pair, so a scatter's root, whose payload is its whole list, and a
    receiver are one call; a send and its receive are one call of their channel)."""
    from workbench.rank.ledger_read import mismatch_kind

    return a.get("group") == b.get("group") and a.get("seq") == b.get("seq") and mismatch_kind(a, b) is None


def _prove(store: Any, key: keys.Attach, world: int) -> dict[str, Any] | None:
    """The ledgers' proof of a deadlock: ranks that wait past the window, each for a member of its call's group
    that waits in another call, in a cycle (so none of their calls can ever complete). A rank that issued no
    call (it may be computing) or whose calls match ends every chain: no proof."""
    calls: dict[int, dict[str, Any]] = {}
    for r in range(world):  # a store that fails raises (``StoreDown``): the watcher counts it
        got = _get(store, key.open(r)) if _has(store, key.open(r)) else None
        if got:
            calls[r] = got[0]  # its earliest open call
    waits = {r: [p for p in (c.get("group_ranks") or range(world)) if p != r and p in calls
                 and not _same(c, calls[p])] for r, c in calls.items()}
    cycle = waitfor.cycle(waits)
    if not cycle:
        return None
    now = time.time()
    line = "; ".join(f"rank {r} waits in {calls[r].get('op')} #{calls[r].get('seq')} on group "
                     f"{calls[r].get('group')} {calls[r].get('shapes')} {','.join(calls[r].get('dtypes') or [])} "
                     f"({calls[r].get('user_frame') or '?'}, {now - float(calls[r].get('t') or now):.0f}s)"
                     for r in cycle)
    return {"kind": "mismatched collectives", "ranks": cycle, "calls": {str(r): calls[r] for r in cycle},
            "waits_for": {str(r): waits[r] for r in cycle}, "line": line}


# -- serving -----------------------------------------------------------------------------------------
def _serve(cap: Watched, watch: Watch, objects: dict[str, Any], alone: dict[str, Any] | None,
           trigger: dict[str, Any] | None = None, on_stuck: Any = None) -> dict[str, Any]:
    """Every rank's part: the attach of the whole job (``engine.attach``), rank 0 writing the post-mortem's
    account into ``engine.json``. A rank that raised waits (store) until rank 0 closed it, then returns."""
    store = engine.job_store()
    key = _key(cap)

    def account() -> dict[str, Any]:
        go = alone or (_peek(store, key.go) if store is not None else None) or trigger or {}
        ranks: dict[str, Any] = {}
        end = time.monotonic() + 10.0
        for r in range(cap.world_size):
            dead = _dead(cap, r)
            while store is not None and not dead and not _there(store, key.rank(r)) and time.monotonic() < end:
                time.sleep(0.05)
            # only a key that is there: the store's get waits for a missing one (its timeout: minutes)
            got = _peek(store, key.rank(r)) if store is not None else None
            ranks[str(r)] = got or dead or {"rank": r, "role": "?", "where": "?"}
        if alone:
            ranks[str(cap.rank)] = {"rank": cap.rank, "role": Role.RAISED.value, "where": alone.get("where")}
        return {"post_mortem": {"reason": go.get("reason"), "rank": go.get("rank"), "error": go.get("error"),
                                "where": go.get("where"), "proof": go.get("proof"), "ranks": ranks,
                                "t": go.get("t"),  # when the rank raised, or the deadlock was proven
                                "line": _line(go, ranks)}}

    try:
        result = engine.attach(cap, "post-mortem", key, "pm", deadline=watch.deadline, objects=objects,
                               doc=account, on_stuck=on_stuck)
        # no rank goes on (fails, is released, ends) before rank 0 closed the attach: the launcher would end the rest
        if store is not None and cap.rank != 0:
            with contextlib.suppress(*STORE_ERRORS):  # not closed in time, or the store gone: this rank goes on
                import datetime

                store.wait([key.closed], datetime.timedelta(seconds=keys.CLOSED_WAIT_S))
        return result
    finally:
        watch.take(Role.SERVED)


def _dead(cap: engine.Host, rank: int) -> dict[str, Any] | None:
    """A rank whose shard ends without a close and whose process is gone (``shards.gone``): it will never answer."""
    from workbench.rank import shard_format

    try:
        doc = json.loads((shard_format.rank_dir(cap.root, rank) / shard_format.MANIFEST).read_text())
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(doc, dict) or not shard_format.gone(doc):
        return None
    after = shard_format.last_point(shard_format.rank_dir(cap.root, rank)) or (doc.get("points") or [None])[-1]
    return {"rank": rank, "role": "dead", "after": after, "line": shard_format.dead_line(rank, after)}


def _line(go: dict[str, Any], ranks: dict[str, Any]) -> str:
    """One line: who raised where, or the deadlock's proof; where each other rank waits."""
    if go.get("reason") == "deadlock":
        return f"deadlock (the ledgers): {(go.get('proof') or {}).get('line', '?')}"
    parts = []
    # the rank that raised first (the one whose error triggered the attach), its message whole (on one line)
    order = sorted(ranks.items(), key=lambda kv: (kv[1].get("role") != "raised", int(kv[0]) != go.get("rank"),
                                                  int(kv[0])))
    for r, info in order:
        if info.get("role") == "raised":
            err = info.get("error") or {}
            parts.append(f"rank {r} raised {err.get('type', '?')}: {' '.join(str(err.get('message', '')).split())} "
                         f"at {info.get('where')}")
        elif info.get("role") == "dead":
            parts.append(info["line"])
        else:
            calls = info.get("open_calls") or []
            in_call = (f" in {calls[0].get('op')} #{calls[0].get('seq')} on group {calls[0].get('group')}"
                       if calls else "")
            parts.append(f"rank {r} waits{in_call} at {info.get('where')}")
    return "; ".join(parts)
