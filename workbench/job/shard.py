"""``capture(dir)``: one rank of the user's own job writing its shard, point by point.

The rank-side parts are the live ranks' own: the probe (``rank/probe.py``) and the row
annotations a live step gets (``remote._annotate``: written since materialisation, the
reference value), poison of what ``to_empty`` and the Python allocators hand out
(``rank/poison.py``), the collectives ledger (``rank/ledger.py``) and the forward trace
(``rank/trace.py``). A ``RankContext`` holds what a point knows (expectations, outputs,
notes), so a point's rows are a live step's rows.

A rank's shard of the run before moves to ``<dir>/previous/rank<r>`` (an elastic restart keeps
its hung attempt). Durability: each point is one JSON line appended to ``points.jsonl``: on CPU written and
flushed before ``point`` returns; on a GPU job handed to the writer thread (``writer.py``), which writes it while
the device works (close, a breakpoint and the job's exception wait for it). The ledger writes a call's start line
(flushed) before the call runs and its end line when the backend says it ended. A job that hangs in a collective,
or is killed in one, leaves that start line with no end: the reader names it as the stuck call. What runs in the
background: that writer (GPU jobs), the post-mortem watcher (``triggers.py``: it polls the job's store; close
joins it) and the ledger's watcher of device calls. An exception that ends the job is one more line
(``sys.excepthook``), and ``kill -USR1`` writes every thread's Python stacks into ``stacks.txt`` (faulthandler;
left alone where the job has its own SIGUSR1 handler).

Where the job runs PyTorch's debug server, a handler of the capture's own answers with this rank's
latest point and its open calls while the job runs or hangs (``debug_server.py``, with the client that
asks it); the shard records the worker's address.

What it costs the job: a point is the probe's own time (CPU: 27 tensors 1-6 ms, 67 MB 0.6-1 s, the same as a
bare probe) and 10-45 KB of JSON. Between points the defaults keep nothing on the job's ops: the ledger wraps
``torch.distributed``'s collective functions (``ledger="calls"``, ``rank/ledger_calls.py``) and is completed by
PyTorch's Flight Recorder for the collectives issued from C++ (DDP's reducer; ``rank/ledger_fr.py``: read at each
point on CPU and every ``FR_READ_EVERY`` (8) points on a GPU job, or sooner where its ring could wrap; at close,
at the job's exception, at a hang and post mortem, and only where the ledger's numbers have a gap), and poison
fills what ``to_empty`` hands out (``poison="to_empty"``), so ``torch.compile`` compiles. The expensive modes stay
a choice: ``ledger="full"`` (or ``True``) puts a ``TorchDispatchMode`` over every aten op (a tiny Qwen3
forward 1.3 -> 4 ms; ``torch.compile`` then runs the model eagerly: the first call 0.02 s instead of a 60 s
compile) and ``poison="all"`` (or ``True``) a ``TorchFunctionMode`` that fills every Python-level ``torch.empty``
the job makes (FSDP2's all-gather buffers included). ``benchmarks/job_capture.py`` measures each mode.

Turned off (``enabled=False``, or ``WORKBENCH_CAPTURE=0`` in the environment), ``capture``
returns a ``NoCapture`` whose methods do nothing: no mode, no file, no import of the probe; it answers
every public method and property of ``Capture`` with the same signature. A directory there
(``WORKBENCH_CAPTURE=runs/x``, what ``workbench job runs/x -- ...`` sets) turns it on into that
directory (said once where it replaces the script's own path), and a process that captures already (the
automatic points of ``hooks.py``) gets its capture (the arguments it drops said once).

The API takes nothing by position that a user would pass as an object (``point(name, *, same_on=...,
**objects)``): a call a method cannot take is said once on stderr and records nothing (``_takes``), never
a ``TypeError`` in the job.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.job import config, debug_server, engine, guest, triggers, writer
from workbench.job.launcher import launcher_env
from workbench.rank import shard_format

ENV_OFF = config.ENV  # an OFF word ("0", "off", "false", "no"): capture is a no-op; a directory: capture into it
ENV_JOB = config.ENV_JOB
ENV_LEDGER = config.ENV_LEDGER  # "calls"/"default" (+ Flight Recorder), "full"/"1", "0": none (config.Ledger)
_CURRENT: list[Capture] = []  # the open capture of this process, for the handler


def capture(path: str | os.PathLike, *, enabled: bool | None = None, poison: bool | str = "to_empty",
            ledger: bool | str = "calls",
            name: str | None = None, job: str | None = None, points: list[str] | None = None,
            attach: bool | str | None = None, attach_deadline: float = 600.0,
            hang_after: float = 60.0, strict: bool = False) -> Capture | NoCapture:
    """Start this rank's capture into ``path/rank<r>/`` (call it on every rank, before building the model).

    Rank, world size and local rank come from the launcher (torchrun's ``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``, srun's ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, else the process group).
    ``poison``: fill what ``to_empty`` hands out with a NaN pattern that only unwritten memory keeps, with no
    cost per op (the default, ``"to_empty"``); ``"all"`` (or ``True``, as before) also every ``torch.empty``-like
    call (a function mode over every call: FSDP2's all-gather buffers included); ``False``: none.
    ``ledger``: ``"calls"`` (the default): around ``torch.distributed``'s collective functions, at no cost per op
    and with ``torch.compile`` still compiling, completed by PyTorch's Flight Recorder for the collectives issued
    from C++ (DDP's reducer; ``rank/ledger_fr.py``: read at each point, at close, at a hang and post mortem);
    ``"full"`` (or ``True``, as before): every collective this thread issues, through a dispatch mode over every
    op (``torch.compile`` then runs eagerly); ``False``: none. The environment's ``WORKBENCH_CAPTURE_LEDGER``
    (``calls``, ``full``, ``0``) overrides it. ``name``: the run's title (default:
    the directory's name). ``job``: the job id every shard carries (default: the launcher's job or run
    id, else one the ranks agree on through the process group's store). ``points``: the names of the points
    the job will reach, in order (optional): a rank stuck on its way to one is read as stuck in that step
    (else in ``after <the last point reached>``), and a run that stopped early reads "k of n steps".
    ``attach``: post mortem, every rank attachable from a notebook (``wb.connect(job=path)``) for
    ``attach_deadline`` seconds: ``"on-error"`` once a rank raises, ``"on-deadlock"`` once the ledgers prove a
    deadlock (every rank in a call open past ``hang_after`` seconds, not one collective), ``"post-mortem"``
    both (``triggers.py`` says how; the raising rank then fails as it would have).
    ``strict``: the capture's own failures (a full disk, a path it cannot make, a bug of the workbench's) raise
    into the job; by default each is one line on stderr and the capture turns itself off on that rank, the job
    going on as it would have without it (``guest.py``).
    """
    given = {k: v for k, v in locals().items() if k in _DEFAULTS and v != _DEFAULTS[k]}  # what the call asked
    on = triggers.modes(attach)
    env = config.from_env()
    if enabled is None:
        enabled = env.enabled
    if enabled and env.directory:  # a directory: capture there
        _replaced(path, env.directory)
        path = env.directory
    if enabled and _CURRENT and not _CURRENT[0]._closed:  # this process captures already (workbench job)
        _dropped(_CURRENT[0], given)
        return _CURRENT[0]
    if enabled:
        ledger = _ledger_mode(env, ledger, strict)
    poison_mode, ledger_mode = config.Poison.of_arg(poison), config.Ledger.of_arg(ledger)
    if poison_mode is None:
        raise ValueError(f"poison must be 'to_empty', 'all' (or True) or False; got {poison!r}")
    if ledger_mode is None:
        raise ValueError(f"ledger must be 'calls', 'full' (or True) or False; got {ledger!r}")
    poison, ledger = poison_mode.arg, ledger_mode.arg
    if "deadlock" in on and not ledger:
        raise ValueError("attach='on-deadlock' reads the ledger: it needs ledger='calls' or 'full'")
    if not (isinstance(attach_deadline, (int, float)) and attach_deadline > 0 and hang_after > 0):
        raise ValueError(f"attach_deadline and hang_after must be positive seconds; got {attach_deadline!r}, "
                         f"{hang_after!r}")
    if not enabled:
        return NoCapture()
    cap = None
    try:
        cap = Capture(path, poison=poison, ledger=ledger, name=name, job=job, points=points, strict=strict)
        cap.watch = triggers.install(cap, on, attach_deadline, hang_after)
        cap._asked = {**_DEFAULTS, **given, "path": os.fspath(path)}
        if cap.watch is not None:  # what the post mortem waits for, in the shard (a test reads --hang-after here)
            cap.doc["attach"] = {"triggers": list(on), "deadline": float(attach_deadline),
                                 "hang_after": float(hang_after)}
            cap._write_manifest()
        return cap
    except Exception as exc:
        if strict:
            if cap is not None:
                cap._stop()
            raise
        if cap is not None:
            cap._fault("at capture", exc)
            return NoCapture(cap.stopped)
        line = (f"workbench: rank {_rank_word()}: capture stopped at capture: {guest.cause(exc, path)}; nothing was "
                "kept; the job goes on without it")
        guest.say(line)
        return NoCapture(line)


_DEFAULTS = {"poison": "to_empty", "ledger": "calls", "name": None, "job": None, "points": None, "attach": None,
             "attach_deadline": 600.0, "hang_after": 60.0, "strict": False}  # capture()'s own, but path and enabled


def _replaced(path: Any, where: str) -> None:
    """``WORKBENCH_CAPTURE=<dir>`` replaces the script's own path: said once, where the two differ."""
    if path is None or os.path.abspath(os.fspath(path)) == os.path.abspath(where):
        return
    say_once(f"workbench: rank {_rank_word()}: {ENV_OFF}={where} replaces the script's capture({os.fspath(path)!r}): "
             "the shards go there")


def _dropped(cap: Capture, given: dict[str, Any]) -> None:
    """``capture(...)`` again while this process captures (``workbench job``'s capture, or the script's first call):
    the open capture is returned; the arguments it does not have are dropped, said once."""
    asked = getattr(cap, "_asked", None) or {}
    dropped = {k: v for k, v in given.items() if k in asked and asked[k] != v}
    if dropped:
        said = ", ".join(f"{k}={v!r}" for k, v in dropped.items())
        say_once(f"workbench: rank {cap.rank}: capture() again returns the open capture ({cap.root}); dropped: {said} "
                 f"(it keeps {', '.join(f'{k}={asked[k]!r}' for k in dropped)})")


_SAID: set[str] = set()  # what this process said once


def say_once(line: str) -> None:
    """One line on stderr (``guest.say``), once per process however often the script makes the call."""
    if line in _SAID:
        return
    _SAID.add(line)
    guest.say(line)


def _takes(nothing: Any = None) -> Any:
    """A public method of the capture (and of ``NoCapture``): a call it cannot take (an object by position, a
    keyword it does not know) is said once and records nothing, answering ``nothing()``; never a ``TypeError`` in
    the job (``strict=True``: it raises). Only a call that does not bind to the signature is taken for one: a
    ``TypeError`` from inside the method is not."""
    import functools
    import inspect

    def wrap(fn: Any) -> Any:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except TypeError as exc:
                try:
                    sig.bind(self, *args, **kwargs)
                except TypeError:
                    if getattr(self, "strict", False):
                        raise
                    hint = " (objects go by keyword: cap.point(\"step1\", model=model))" if args else ""
                    say_once(f"workbench: rank {self.rank}: cap.{fn.__name__}() cannot take this call: {exc}{hint}; "
                             "it recorded nothing")
                    return nothing() if callable(nothing) else nothing
                raise

        return method

    return wrap


def _ledger_mode(env: config.CaptureConfig, ledger: bool | str, strict: bool) -> bool | str:
    """``WORKBENCH_CAPTURE_LEDGER`` over the script's ``ledger``. The environment's bad values are said once and
    ignored (a bad ledger: the script's own choice stands, not silently the most expensive mode); ``strict``: the
    first raises instead."""
    if strict and env.problems:
        raise ValueError(next(iter(env.problems.values())))
    say_problems(env)
    return ledger if env.ledger is None else env.ledger.arg


def say_problems(env: config.CaptureConfig) -> config.CaptureConfig:
    """The environment's bad values (``config.py``: each ignored, its default used), each said once per process
    however often the environment is read; returns ``env``."""
    for line in env.problems.values():
        say_once(f"workbench: rank {_rank_word()}: {line}")
    return env


def _rank_word() -> str:
    """This process's rank for a line said before the launcher's variables were read (they may be the fault)."""
    try:
        return str(launcher_env(dist_ok=False)["rank"])
    except Exception:
        return os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "?"


class NoCapture:
    """Capture switched off: every call returns at once, and it answers every public method and property of
    ``Capture`` with the same signature (``tests/test_job_guest.py`` compares them), so a script runs the same with
    the capture off. ``stopped``: the line said where a fault stopped it at ``capture`` (None where it was
    switched off)."""

    enabled = False
    closed = True
    attempt = 0
    device = None
    latest = None
    device_held = None
    ledger_path = None
    job_excepthook = None
    objects: dict[str, Any] = {}

    def __init__(self, stopped: str | None = None) -> None:
        self.stopped = stopped
        self.strict = False
        self.rank, self.world_size = _where_quietly()
        self.root = self.dir = self.job = self.ctx = self.serving = self.watch = None
        self.points: list[str] = []
        self.doc: dict[str, Any] = {}

    @_takes()
    def point(self, name: str, *, same_on: Any = "learned", **objects: Any) -> dict[str, Any] | None:
        return None

    @_takes()
    def output(self, name: str, tensor: Any, **extra: Any) -> None:
        return None

    @_takes()
    def expect(self, name: str, value: Any) -> None:
        return None

    @_takes()
    def local(self, *keys: str) -> None:
        return None

    @_takes()
    def note(self, message: str) -> None:
        return None

    @_takes(contextlib.nullcontext)
    def trace(self, model: Any, *, run: str = "model") -> Any:
        return contextlib.nullcontext()

    @_takes(lambda: {"by": "off", "seconds": 0.0})
    def breakpoint(self, *, deadline: float = 600.0, controller: str | os.PathLike | None = None,
                   **objects: Any) -> dict[str, Any]:
        return {"by": "off", "seconds": 0.0}

    @_takes()
    def post_mortem(self, exc: BaseException | None = None) -> dict[str, Any] | None:
        return None

    @_takes(True)
    def flush(self, timeout: float = writer.DRAIN_S) -> bool:
        return True

    @_takes()
    def snapshot(self) -> dict[str, Any]:
        return {}

    @_takes()
    def files(self) -> dict[str, Any]:
        return {}

    @_takes()
    def open_calls(self) -> list[dict[str, Any]]:
        return []

    @_takes(0)
    def fill_from_flight_recorder(self, when: str, hang: bool = False, marked_only: bool = False) -> int:
        return 0

    @_takes(0)
    def watch_flight_recorder(self, still_for: float) -> int:
        return 0

    @_takes()
    def on_close(self, undo: Callable[[], Any]) -> None:
        return None

    @_takes()
    def close(self) -> None:
        return None

    def __enter__(self) -> NoCapture:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"<NoCapture rank {self.rank}/{self.world_size}: off{': ' + self.stopped if self.stopped else ''}>"


def _where_quietly() -> tuple[int, int]:
    """Rank and world size as the launcher set them, without asking a process group (0 and 1 where they cannot
    be read: with the capture off nothing may fail)."""
    try:
        where = launcher_env(dist_ok=False)
        return int(where["rank"]), int(where["world_size"])
    except Exception:
        return 0, 1


def _launcher_job() -> str | None:
    job = config.from_env().job
    if job:
        return job
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}" + (f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else "")
    run = env.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":  # torchrun's default static rendezvous calls every run "none"
        return f"torchrun-{run}"
    return None


def _store_job() -> str | None:
    """An id every rank of this process group reads the same: the first rank to ask writes it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        got = store.compare_set("workbench/job", "", f"job-{uuid.uuid4().hex[:12]}")
        return got.decode() if isinstance(got, bytes) else str(got)
    except Exception:
        return None


class Capture:
    """This rank's capture: ``point`` probes and appends, ``close`` (or exit) marks the shard finished."""

    def __init__(self, path: str | os.PathLike, *, poison: bool | str = "to_empty", ledger: bool | str = "calls",
                 name: str | None = None, job: str | None = None, points: list[str] | None = None,
                 strict: bool = False):
        import torch

        from workbench.rank import context

        self.strict = strict
        self.stopped: str | None = None  # the one line a fault said; the capture is off from then on
        self._closed = True  # until installed: close() has nothing to undo
        self._unwound = False
        self._fault_lock = threading.Lock()
        self._stack = contextlib.ExitStack()  # every install step's undo, last first (close, a fault, a failed start)
        self._ledger: Any = None
        self._fr: Any = None  # Flight Recorder's complement of the calls ledger (rank/ledger_fr.py)
        self._calls: Any = None  # the calls ledger (rank/ledger_calls.py), where ledger="calls"
        self._fr_lock = threading.Lock()
        self._fr_still: tuple[Any, float] = ((), 0.0)  # the groups' counts a hang's read last saw, and since when
        self._writer: writer.Writer | None = None  # finishes each point on its own thread (a GPU job: writer.py)
        self._gc = writer.GcHold()
        self._writer_chosen = False
        self._poison_mode: Any = None
        self._hook = sys.excepthook
        # the last point: its record until written, then its line (one string: its thousands of rows die by refcount
        # instead of ageing into the job's oldest GC generation, which would make full collections come sooner)
        self._latest: dict[str, Any] | str | None = None
        self._objects: dict[str, Any] = {}  # the last point's objects (not its tensors): a breakpoint's namespace
        self._objects_weak = True
        self.serving: engine.Serving | None = None  # the attach in progress, while this rank serves
        self.watch: triggers.Watch | None = None  # the post-mortem watch (``capture(attach=...)``)
        where = launcher_env()
        self.rank, self.world_size = where["rank"], where["world_size"]
        self.root = Path(path)
        self.dir = shard_format.rank_dir(self.root, self.rank)
        self._job_given = job or _launcher_job()
        self.job = self._job_given or _store_job()
        self.points: list[str] = []
        self._written: list[str] = []  # the points whose line is on disk (the writer may be behind ``points``)
        self._t_last = time.time()
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)
        self.ctx = context.RankContext(rank=self.rank, world_size=self.world_size, device=torch.device("cpu"),
                                       backend="", poison=bool(poison), workdir=str(self.dir))
        self.doc: dict[str, Any] = {
            "format": shard_format.FORMAT, "schema": shard_format.SCHEMA, "job": self.job,
            "name": name or self.root.name, "rank": self.rank, "world_size": self.world_size,
            "local_rank": where["local_rank"],
            "launcher": where["launcher"], "attempt": attempt, "host": shard_format.host(), "pid": os.getpid(),
            "argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]] if sys.argv else [],
            "poison": poison, "ledger": ledger, "backend": "", "device": "cpu",
            "started_at": self._t_last, "updated_at": self._t_last, "status": "running", "points": [],
            "planned": [str(p) for p in points or []],
            "versions": _versions(),
        }
        try:
            self._install(poison, ledger, attempt)
        except BaseException:
            with contextlib.suppress(Exception):
                self._unwind()
            self._unwound = True
            raise
        self._closed = False
        self._prebuild()

    def _prebuild(self) -> None:
        """Start the fused probe's kernel build now, in a child (GPU machines with a cold Triton cache only):
        until it is built every point takes the plain path, and a build begun at the first point finished after
        the job's 22 steps on a fresh H200 (fixtures/gpu/job_leave_on_1gpu.json); begun here, points ran fused
        from step 15. A capture that cannot start it goes on without: the build then happens at the first point."""
        from workbench.rank import probe_child

        try:
            probe_child.prebuild_probe()
        except OSError as exc:  # a child that cannot start (no fork, no python): the in-process build remains
            guest.say(f"workbench: rank {self.rank}: the probe's kernel builds at the first point instead: "
                      f"{guest.cause(exc)}")

    def _install(self, poison: bool | str, ledger: bool | str, attempt: int) -> None:
        """Install step by step, each step's undo on the stack before the next step runs: a step that fails
        (the ledger's file, the stacks file) leaves nothing of the steps before it (no mode, no wrapper)."""
        from workbench.rank import agree
        from workbench.rank import ledger as ledger_mod
        from workbench.rank import poison as poison_mod

        stack = self._stack
        _keep_previous(self.root, self.rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._points_file = open(self.dir / shard_format.POINTS, "a", buffering=1)
        stack.callback(self._points_file.close)
        stack.callback(poison_mod.uninstall)
        poison_mod.reset_tracking()
        agree.forget()  # what an earlier capture in this process synced is not this run's
        poison_mod.set_poison(bool(poison))  # to_empty tracked either way (without poison: by fingerprint)
        self._poison = poison_mod
        if not self.strict:
            poison_mod._STATE["guest"] = lambda exc: self._fault("in the poison's hook", exc, now=False)
        if poison is True:  # also torch.empty and the other Python allocators: a function mode over every call
            self._poison_mode = poison_mod._Allocations()
            self._poison_mode.__enter__()
            stack.callback(self._leave_poison_mode)
        if ledger:
            self._ledger = ledger_mod.Ledger(str(self.dir), self.rank, session=self.job or "", attempt=attempt)
            stack.callback(self._ledger.close, settle_later=True)  # calls still running end later
            if not self.strict:
                self._ledger.guest = lambda exc: self._fault("in the ledger's hook", exc, now=False)
            self._ledger.step = "0"  # calls on the way to point 0; the reader names them after it
            if ledger == "calls":  # around the job's collective calls only: no per-op cost, torch.compile compiles
                from workbench.rank.ledger_calls import CallLedger

                calls = CallLedger(self._ledger)
                stack.callback(calls.uninstall)
                calls.install()
                from workbench.rank.ledger_fr import Complement, records, switch_on

                switch_on()  # where no process group exists yet and the job set no buffer size of its own
                calls.flight_recorder = records()  # NCCL's hot calls then pass to its record (ledger_calls.FR_OPS)
                self._calls = calls
                self._fr = Complement(self._ledger)
                self.doc["flight_recorder"] = True
                # A job that destroys its groups before the capture closes: their record is read there, on every
                # rank (at close there is nothing left to read, and a rank whose hang watcher had read it while
                # the rank lingered would be the only one to hold its last calls).
                stack.callback(ledger_mod.before_destroy(
                    lambda: self.fill_from_flight_recorder("before destroy_process_group")))
            else:
                stack.callback(ledger_mod.start_recording(self._ledger, "0"))
        if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            stacks_file = open(self.dir / shard_format.STACKS, "w")
            stack.callback(stacks_file.close)
            faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True, chain=False)
            stack.callback(faulthandler.unregister, signal.SIGUSR1)
        self._hook = sys.excepthook
        sys.excepthook = self._excepthook
        stack.callback(self._give_back_excepthook)
        atexit.register(self.close)
        stack.callback(atexit.unregister, self.close)
        _CURRENT[:] = [self]
        stack.callback(self._forget)
        debug_server.register(_open_capture)
        self._write_manifest()

    def _leave_poison_mode(self) -> None:
        from workbench.rank.ledger import leave_mode

        if not leave_mode(self._poison_mode, dispatch=False):
            self._poison_mode.off = True  # a mode the job pushed since sits above it: it stays, passing through

    def _give_back_excepthook(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._hook

    def _forget(self) -> None:
        if _CURRENT and _CURRENT[0] is self:
            _CURRENT.clear()

    @_takes()
    def on_close(self, undo: Callable[[], Any]) -> None:
        """Run ``undo`` when the capture closes or a fault stops it, before what it installed itself is undone
        (last registered, first run): what a caller patched on the capture's behalf goes with it."""
        if self._closed:
            undo()
        else:
            self._stack.callback(undo)

    def _unwind(self) -> None:
        """Every install step undone, last first (each runs whatever the others do; the first error is raised
        after)."""
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.close()

    @property
    def enabled(self) -> bool:
        return self.stopped is None and not self._closed

    # -- what an attach reads (``engine.Host``) ------------------------------------------------
    @property
    def attempt(self) -> int:
        """The launcher's restart count (torchelastic's), as the shard records it."""
        return int(self.doc.get("attempt", 0))

    @property
    def device(self) -> Any:
        """This rank's device, as its last point saw it (cpu until one saw CUDA)."""
        return self.ctx.device

    @property
    def latest(self) -> dict[str, Any] | None:
        """The last point's record (its rows), or None before the first."""
        latest = self._latest
        return json.loads(latest) if isinstance(latest, str) else latest

    @property
    def device_held(self) -> str | None:
        """Why the post mortem could not free this rank's device (its communicators' abort failed), else None."""
        return self.watch.device_held if self.watch is not None else None

    # -- what the post-mortem watch reads (``triggers.Watched``) -------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def ledger_path(self) -> str | None:
        """This rank's ledger file, None without a ledger."""
        return self._ledger.path if self._ledger is not None else None

    @property
    def job_excepthook(self) -> Any:
        """The excepthook the capture took over: what runs the job's own failure as it would have been."""
        return self._hook

    @property
    def objects(self) -> dict[str, Any]:
        """The last point's objects (not its tensors), the namespace a breakpoint's engines see. Held weakly where the
        capture attaches nothing post mortem (a point does not keep the job's model or state dict alive): what
        cannot be held weakly (a dict) is not kept, what was freed since is left out."""
        if not self._objects_weak:
            return dict(self._objects)
        out = {}
        for key, ref in self._objects.items():
            obj = ref()
            if obj is not None:
                out[key] = obj
        return out

    def _remember(self, objects: dict[str, Any]) -> None:
        self._objects_weak = self.watch is None
        if not self._objects_weak:
            self._objects = dict(objects)
            return
        refs = {}
        for key, obj in objects.items():
            with contextlib.suppress(TypeError):
                refs[key] = weakref.ref(obj)
        self._objects = refs

    # -- the guest's rule: the capture's own faults are one line, never the job's ----------------
    def _usable(self) -> bool:
        """Whether a call into the capture records: not once closed, nor once a fault stopped it (a hook's fault,
        said on another thread or inside a mode, is unwound here, on the job's own thread)."""
        if self.stopped is not None:
            self._stop()
            return False
        return not self._closed

    def _kept(self) -> str:
        n = len(self._written)
        return f"{self.dir} keeps {n} point(s)" + (f" up to `{self._written[-1]}`" if n else "")

    def _fault(self, where: str, exc: BaseException, now: bool = True) -> None:
        """A fault of the capture's own: one line on stderr (once), the capture off on this rank. ``now``: on the
        job's thread, outside any hook: unwind at once (else the modes go at the job's next call into it)."""
        with self._fault_lock:
            first = self.stopped is None
            if first:
                self.stopped = (f"workbench: rank {self.rank}: capture stopped {where}: {guest.cause(exc, self.dir)}; "
                                f"{self._kept()}; the job goes on without it")
        if first:
            if self._ledger is not None:
                self._ledger.off = True
            if self._poison_mode is not None:
                self._poison_mode.off = True
            from workbench.rank import poison as poison_mod

            poison_mod._STATE["poison"] = False
            guest.say(self.stopped)
        if now:
            self._stop()

    def _stop(self) -> None:
        """After a fault: every install step undone, the shard marked stopped where it still can be written."""
        if self._unwound:
            return
        self._unwound = self._closed = True
        if self._writer is not None:  # what it has left skips itself (stopped); the files close after it
            self._writer.drain(2.0)
        if self.watch is not None:
            self.watch.end()
        with contextlib.suppress(Exception):
            self._unwind()
        self.doc.update(status="stopped", stopped=self.stopped)
        with contextlib.suppress(Exception):
            self._write_manifest()

    # -- what a point records -------------------------------------------------------------
    @_takes()
    def output(self, name: str, tensor: Any, **extra: Any) -> None:
        """An output for the next point (logits, a loss), with scalar extras (``ref_max_abs_diff=...``)."""
        if self._usable():
            self.ctx.output(name, tensor, **extra)

    @_takes()
    def expect(self, name: str, value: Any) -> None:
        """What tensor ``name`` (as probed, e.g. ``model.model.rotary_emb.inv_freq``) should hold."""
        if self._usable():
            self.ctx.expect(name, value)

    @_takes()
    def local(self, *keys: str) -> None:
        """Objects (by the point's keyword) that are this rank's own, never compared with rank 0's."""
        if self._usable():
            self.ctx.local(*keys)

    @_takes()
    def note(self, message: str) -> None:
        """A line for the next point: what this rank did that the tables cannot show."""
        if self._usable():
            self.ctx.note(message)

    @_takes(contextlib.nullcontext)
    def trace(self, model: Any, *, run: str = "model") -> Any:
        """Trace one forward of ``model`` (a row per module call); the rows go with the next point."""
        from workbench.rank.trace import trace_forward

        if not self._usable():
            return contextlib.nullcontext()
        try:
            return trace_forward(self.ctx, model, run=run)
        except Exception as exc:
            if self.strict:
                raise
            self._fault("at trace", exc)
            return contextlib.nullcontext()

    @_takes()
    def point(self, name: str, *, same_on: Any = "learned", **objects: Any) -> dict[str, Any] | None:
        """Probe ``objects`` on this rank now and append them to the shard as point ``name``.

        Objects go by keyword only (``cap.point("step1", model=model)``): a call with one by position
        (``cap.point("x", model)``) is said once on stderr and records nothing (``_takes``).

        Modules and dicts of tensors are probed tensor by tensor (the ``tensors`` table); a bare
        tensor is an output (``logits=out``), as ``output(name, t)`` records it. ``same_on``: the ranks the
        bare tensors must agree across (``"world"``, a group, ranks; None: each rank's own; a dict per
        output name); left out, learned (``rank/agree.py``). Returns the point's size: rows, bytes written,
        seconds spent; None where the capture is closed or a fault stopped it (a fault here is one line on
        stderr: ``guest.py``).
        """
        if not self._usable():
            return None
        self._gc.hold()  # released once the point is written (on the writer, when it writes)
        handed = False
        try:
            info = self._point(name, same_on, objects)
            handed = info.pop("_handed", False)
            return info
        except Exception as exc:
            if self.strict:
                raise
            self._fault(f"at point `{name}`", exc)
            return None
        finally:
            if not handed:
                self._gc.release()

    def _point(self, name: str, same_on: Any, objects: dict[str, Any]) -> dict[str, Any]:
        import torch

        from workbench.rank import probe, remote, trace

        t0 = time.perf_counter()
        now = time.time()
        if self.job is None:
            self.job = _store_job() or f"local-{shard_format.host()}-{os.getppid()}"
            if self._ledger is not None:
                self._ledger.session = self.job
        if not self.points and torch.cuda.is_available() and torch.cuda.is_initialized():
            from workbench.rank import probe_fused

            probe_fused.warm_async(plain_meanwhile=True)  # the fused kernel builds aside; until then, the plain path
        self._where()
        self._choose_writer()
        when = f"before point `{name}`"
        read_fr = False  # the calls on the way here: read now, or by the writer once the point is handed over
        if self._fr is not None and self._ledger is not None:
            self._fr.mark(str(self._ledger.step))
            if self._writer is None:
                self.fill_from_flight_recorder(when)
            else:
                read_fr = self._fr.due(FR_READ_EVERY)
        objects = dict(objects)
        for key, value in list(objects.items()):
            if isinstance(value, torch.Tensor):
                spec = same_on.get(key, "learned") if isinstance(same_on, dict) else same_on
                self.ctx.output(key, value, same_on=spec)
                del objects[key]
        self._remember(objects)
        with self._poison.poisoned(False):  # the probe's own scratch is not the job's memory
            held: dict[str, list] = {}
            rows = probe.probe_objects(objects, self.rank, held)
            remote._annotate(rows, objects, self.ctx, held)
            outputs = probe.probe_dict(self.ctx.outputs, self.rank, kind="output")
        remote.annotate_outputs(outputs, self.ctx)
        record = {"kind": "point", "point": name, "index": len(self.points), "t": now,
                  "elapsed": now - self._t_last, "probe_s": time.perf_counter() - t0, "tensors": rows,
                  "outputs": outputs, "trace": trace.take(self.ctx), "notes": self.ctx.notes[:]}
        self.ctx.outputs.clear()
        self.ctx.output_extras.clear()
        self.ctx.notes.clear()
        self.points.append(name)
        self._latest = record
        if self._ledger is not None:
            self._ledger.step = str(len(self.points))  # what follows is on the way to the next point
        info = {"point": name, "rows": len(rows) + len(outputs), "bytes": None, "seconds": 0.0}
        points = list(self.points)
        if self._writer is None:
            self._finish_point(record, info, points)
        else:  # bytes filled in once written (``flush``)
            self._writer.submit(f"at point `{name}`", lambda: self._finish_handed(record, info, points))
            info["_handed"] = True
            if read_fr:  # after the point's own work: the writer reads while the job launches its next step
                self._writer.submit(f"reading Flight Recorder {when}",
                                    lambda: self.fill_from_flight_recorder(when, marked_only=True))
        self._t_last = time.time()
        info["seconds"] = time.perf_counter() - t0
        return info

    def _finish_handed(self, record: dict[str, Any], info: dict[str, Any], points: list[str]) -> None:
        try:
            self._finish_point(record, info, points)
        finally:
            self._gc.release()

    def _finish_point(self, record: dict[str, Any], info: dict[str, Any], points: list[str]) -> None:
        """The point's line and the manifest (on a GPU job, on the writer thread)."""
        if self.stopped is not None:
            return  # a fault stopped the capture meanwhile: what it kept is what it said
        line = json.dumps(record, default=shard_format.plain) + "\n"
        self._points_file.write(line)
        self._points_file.flush()
        self._written = points
        if self._latest is record:  # not a later point's, handed over meanwhile
            self._latest = line
        info["bytes"] = len(line)
        if self._ledger is not None:
            self._settle()
        self._write_manifest(points)

    def _choose_writer(self) -> None:
        """Once, at the first point (the device is known by then): the writer thread on a GPU job."""
        if self._writer_chosen:
            return
        self._writer_chosen = True
        if writer.wanted(self.ctx.device.type == "cuda", self.strict):
            self._writer = writer.Writer(lambda where, exc: self._fault(where, exc, now=False))
            self._stack.callback(self._writer.stop)

    @_takes(True)
    def flush(self, timeout: float = writer.DRAIN_S) -> bool:
        """Wait until every point handed to the writer is on disk (a GPU job's points are written aside); True
        when nothing is left. Close, a breakpoint, the job's exception and the debug server do it themselves."""
        return self._writer is None or self._writer.drain(timeout)

    @_takes(lambda: {"by": "off", "seconds": 0.0})
    def breakpoint(self, *, deadline: float = 600.0, controller: str | os.PathLike | None = None,
                   **objects: Any) -> dict[str, Any]:
        """Every rank (at the same point) serves as an ipyparallel engine until ``cluster.resume()`` from a
        client (``wb.connect(job=<this capture's dir>)``) or ``deadline`` seconds; then the script goes on with
        whatever the notebook changed. The engines see ``objects``, the last point's objects and ``cap``
        (``workbench/job/engine.py`` says how it returns)."""
        if not self._usable():
            return {"by": "off", "seconds": 0.0}
        self.flush()
        return engine.serve(self, deadline=deadline, controller=controller, **objects)

    @_takes()
    def post_mortem(self, exc: BaseException | None = None) -> dict[str, Any] | None:
        """In an ``except`` that ends the rank without the exception reaching ``sys.excepthook`` (a
        ``sys.exit(1)`` after logging): serve every rank post mortem for ``exc`` (default: the one being
        handled), as ``capture(attach="on-error")`` does for an uncaught one. Returns how it ended."""
        if not self._usable():
            return None
        exc = exc if exc is not None else sys.exc_info()[1]
        if exc is None:
            raise ValueError("cap.post_mortem() needs an exception: call it in an except block, or pass one")
        if self.watch is None or "error" not in self.watch.triggers:
            raise ValueError("cap.post_mortem() needs the capture's attach='on-error' (or 'post-mortem') on "
                             "every rank: their threads serve the ranks that did not raise")
        self.flush()
        return triggers.on_exception(self, self.watch, exc, exc.__traceback__)

    # -- the shard's own state --------------------------------------------------------------
    def _where(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.doc["backend"] = dist.get_backend()
            self.ctx.backend = self.doc["backend"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            dev = torch.device("cuda", torch.cuda.current_device())
            self.ctx.device = dev
            self.doc["device"] = f"{dev} {torch.cuda.get_device_name(dev)}"

    def _write_manifest(self, points: list[str] | None = None) -> None:
        self.doc.update(job=self.job, points=list(self.points) if points is None else points, updated_at=time.time())
        url = debug_server.worker_url()
        if url is not None:  # the job runs PyTorch's debug server: where this rank's worker answers
            self.doc["debug_server"] = url
        shard_format.write_json_atomic(self.dir / shard_format.MANIFEST, self.doc)

    def _excepthook(self, kind: type, exc: BaseException, tb: Any) -> None:
        if getattr(self, "_telling", False):  # ``_tell`` runs the hooks around this one: print, as the job's hook
            self._hook(kind, exc, tb)
            return
        # the post mortem stopped this waiting rank (or its aborted communicators raised): not the job's error
        released = isinstance(exc, triggers.Released) or triggers.was_released(self.watch)
        if self.stopped is None and not self._closed:
            with contextlib.suppress(Exception):
                self.flush()
                self.fill_from_flight_recorder("at the job's exception")
            try:
                from workbench.rank.ledger import traceback_text

                text = traceback_text(exc) if exc is not None else "".join(traceback.format_exception(kind, exc, tb))
                self._points_file.write(json.dumps({
                    "kind": "error", "index": len(self.points), "t": time.time(), "error": kind.__name__,
                    "message": str(exc)[:2000], "traceback": text[-6000:],
                    **({"released": True} if released else {})}) + "\n")
                self._points_file.flush()
                self.doc["status"] = "released" if released else "raised"
                self._write_manifest()
            except Exception as hook_exc:  # one line, then the job's own exception as it would have been
                self._fault("recording the job's exception", hook_exc)
        # the traceback at once, as Python would print it, before any wait for a notebook; and only once
        told = not released and not self._closed and triggers.may_wait(self.watch, exc)
        if told:
            self._tell(kind, exc, tb)
        if self.watch is not None and not self._closed:
            try:
                triggers.on_exception(self, self.watch, exc, tb, told=told)
            except KeyboardInterrupt:  # Ctrl-C (the launcher passes it on) ended the wait: the job fails now
                pass
            except BaseException as pm_exc:  # never in the way of the job's own failure
                guest.say(f"workbench: rank {self.rank}: the post-mortem attach failed: {guest.cause(pm_exc)}")
        if released:  # it waited above until the attach was over; the rank ends with one line, exit status 1
            with contextlib.suppress(Exception):
                sys.__stderr__.write(triggers.released_line(self.rank, self.watch, exc))
                sys.__stderr__.flush()
            return
        if not told:
            self._hook(kind, exc, tb)

    def _tell(self, kind: type, exc: BaseException, tb: Any) -> None:
        """What the job would have printed for ``exc``, now, before the post mortem waits rather than after it.

        The whole chain of excepthooks runs, not only the one the capture took over: a hook set after the capture's
        may wrap it and hold what it prints until it returns (``init_process_group``'s own puts a ``[rank1]:``
        before each line, printing into a buffer meanwhile). So the outermost hook runs again here, on the
        process's own stderr, and the capture's hook, called inside it, only prints (``_telling``)."""
        held = sys.stderr
        self._telling = True
        try:
            if isinstance(held, io.StringIO):  # inside a wrapping hook that buffers: the real stream for this one
                sys.stderr = sys.__stderr__
            outer = sys.excepthook if sys.excepthook is not self._excepthook else self._hook
            outer(kind, exc, tb)
        except Exception:
            with contextlib.suppress(Exception):
                sys.__excepthook__(kind, exc, tb)
        finally:
            self._telling = False
            sys.stderr = held
        with contextlib.suppress(Exception):
            sys.__stderr__.flush()

    @_takes()
    def snapshot(self) -> dict[str, Any]:
        """What the debug-server handler answers: this rank's latest point (its rows) and open calls."""
        self.flush(5.0)
        return {"rank": self.rank, "world_size": self.world_size, "job": self.job, "status": self.doc["status"],
                "points": list(self.points), "latest": self.latest, "open_calls": self.open_calls()}

    @_takes()
    def files(self) -> dict[str, Any]:
        """This rank's whole shard as text (``?shard=1``): what ``fetch`` writes into a directory to read."""
        self.flush(5.0)
        out: dict[str, Any] = {"rank": self.rank, "files": {}}
        names = [shard_format.MANIFEST, shard_format.POINTS, shard_format.STACKS, f"rank{self.rank}.jsonl"]
        for name in names:
            try:
                out["files"][name] = (self.dir / name).read_text(errors="replace")
            except OSError:
                pass
        return out

    def _settle(self) -> None:
        """The ends of the calls whose device work finished by now (the probe's copies waited for the stream)."""
        with contextlib.suppress(Exception):
            from workbench.rank import ledger as ledger_mod

            ledger_mod.settle()

    @_takes()
    def open_calls(self) -> list[dict[str, Any]]:
        """The collectives this rank started and saw no end of, read from its own ledger file, oldest first (Flight
        Recorder's record first fills what the calls ledger could not see: the rank may wait in one of those)."""
        if self._ledger is None:
            return []
        self.flush(5.0)  # the points' own reads first, each labelling its calls with its step
        self.fill_from_flight_recorder("while the rank waits", hang=True)
        return triggers.open_calls(triggers.ledger_reader(self._ledger.path))

    @_takes(0)
    def fill_from_flight_recorder(self, when: str, hang: bool = False, marked_only: bool = False) -> int:
        """Write into the ledger the collectives Flight Recorder recorded and the calls ledger did not (issued from
        C++); nothing is read while the ledger's numbers have no gap. Returns how many rows; a fault of its own is
        one line (``guest.py``) and the capture goes on without the complement."""
        if self._fr is None:
            return 0
        with self._fr_lock:  # the job's thread, the writer and the watcher: one reads, one says a fault, once
            fr = self._fr
            if fr is None:  # another thread's fault took it off meanwhile
                return 0
            try:
                return fr.fill(when, hang=hang, marked_only=marked_only)
            except Exception as exc:
                if self.strict:
                    raise
                self._fr = None
                if self._calls is not None:  # the calls it was to fill are recorded here again from now on
                    self._calls.flight_recorder = False
                guest.say(f"workbench: rank {self.rank}: Flight Recorder's record is no longer read: "
                          f"{guest.cause(exc)}; the calls ledger goes on without it")
                return 0

    @_takes(0)
    def watch_flight_recorder(self, still_for: float) -> int:
        """The post-mortem watcher's read (its own thread): once no group's count has moved for ``still_for``
        seconds and the ledger has gaps, the rank may wait inside a call only Flight Recorder saw: fill, its
        newest call left open."""
        if self._fr is None:
            return 0
        from workbench.rank import ledger_fr
        from workbench.rank.ledger import backend_seq

        counts = tuple(backend_seq(pg) for pg, _ in ledger_fr.groups())
        now = time.monotonic()
        if counts != self._fr_still[0]:
            self._fr_still = (counts, now)
            return 0
        if now - self._fr_still[1] < still_for:
            return 0
        return self.fill_from_flight_recorder("while the rank waits", hang=True)

    @_takes()
    def close(self) -> None:
        """Stop recording and poisoning; the shard says the rank finished (unless it raised). A fault here is one
        line on stderr (``guest.py``)."""
        if not self._usable():
            return
        self.flush()
        with contextlib.suppress(Exception):
            self.fill_from_flight_recorder("at close")
        # The fused probe's kernel still building when a short job ends is not left mid-build at interpreter exit;
        # bounded, since a build queued behind a stuck collective never ends.
        with contextlib.suppress(Exception):
            from workbench.rank import probe_fused

            probe_fused.settle_warm(WARM_AT_CLOSE_S)
        self._closed = self._unwound = True
        try:
            if self.watch is not None:
                self.watch.end()
            self._unwind()
            if self.doc["status"] == "running":
                self.doc["status"] = "finished"
            hooks = getattr(self, "hooks", None)  # the automatic points (``workbench job``): how far they followed
            if hooks is not None and "step" in hooks.points:
                self.doc["followed"] = hooks.followed()
            self._write_manifest()
        except Exception as exc:
            if self.strict:
                raise
            self._fault("at close", exc)
            with contextlib.suppress(Exception):
                self._unwind()  # whatever the failed step left

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Capture rank {self.rank}/{self.world_size} job {self.job} -> {self.dir}: {len(self.points)} point(s)>"


WARM_AT_CLOSE_S = 20.0
# A GPU job's capture reads Flight Recorder every this many points (or sooner, before its ring could wrap): reading
# the whole ring took 4 ms a point on 2 x H200 (torch 2.11, ~50 calls a step, a 2000-entry ring), the dearest part
# of a point; each call is still named by the point it led to (``ledger_fr.Complement.mark``).
FR_READ_EVERY = 8


def _open_capture() -> Capture | None:
    """The open capture of this process (what the debug-server handler answers for), or None."""
    return _CURRENT[0] if _CURRENT else None


def _keep_previous(root: Path, rank: int) -> None:
    """This rank's shard of the run before (an elastic restart's earlier attempt, a rerun into the same
    directory) moves to ``<root>/previous/rank<r>``, which opens as shards of its own; the one before
    that goes."""
    import shutil

    here = shard_format.rank_dir(root, rank)
    if not (here / shard_format.MANIFEST).exists():
        return
    prev = shard_format.rank_dir(root / "previous", rank)
    shutil.rmtree(prev, ignore_errors=True)
    prev.parent.mkdir(parents=True, exist_ok=True)
    os.replace(here, prev)


def _versions() -> dict[str, str]:
    import importlib.metadata as md
    import platform

    from workbench.rank.columns import cpu_model, kernel_knobs

    out = {"python": platform.python_version(), "cpu": cpu_model()}
    for pkg in ("torch", "transformers", "workbench"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "absent"
    return out | kernel_knobs()  # the float kernels this rank runs (SIMD width, oneDNN ISA), where set
