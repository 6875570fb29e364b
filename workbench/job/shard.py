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
**objects)``): a call a method cannot take is said once on stderr and records nothing (``_takes``:
``api.py``), never a ``TypeError`` in the job.

``Capture`` here is what installs the capture, closes it and stops it at a fault of its own (the guest's rule);
the rest is its parts, one module a responsibility: ``capture_points.py`` (what a point records and writes),
``capture_attach.py`` (a breakpoint, the post mortem, the exception hook) and ``capture_reads.py`` (what an
attach, the post-mortem watch and the debug server read).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.job import api, config, debug_server, engine, guest, process, teardown, triggers, writer
from workbench.job.api import takes as _takes
from workbench.job.capture_attach import Attach
from workbench.job.capture_points import FR_READ_EVERY, Points  # noqa: F401 (FR_READ_EVERY: read here as before)
from workbench.job.capture_points import store_job as _store_job
from workbench.job.capture_reads import Reads
from workbench.job.launcher import launcher_env
from workbench.rank import shard_files, shard_format

ENV_OFF = config.ENV  # an OFF word ("0", "off", "false", "no"): capture is a no-op; a directory: capture into it
ENV_JOB = config.ENV_JOB
ENV_LEDGER = config.ENV_LEDGER  # "calls"/"default" (+ Flight Recorder), "full"/"1", "0": none (config.Ledger)


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
    already = process.STATE.open_capture()
    if enabled and already is not None:  # this process captures already (workbench job)
        _dropped(already, given)
        return already
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
    except Exception as exc:  # the boundary of capture(): the job gets a NoCapture and one line
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


# A call a public method cannot take (``api.takes``, below this module) is said by this say_once: one memory of what
# was said per process, here where a test empties it (``shard._SAID``).
api.say_once = say_once


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
    except (KeyError, ValueError):  # a launcher variable missing or not a number
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
    except (KeyError, ValueError):  # a launcher variable missing or not a number
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


class Capture(Points, Attach, Reads):
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
        self._latest_at = -1  # the latest's point index
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
        except BaseException:  # any failure of the install, the job's Ctrl-C too: undo, then raise it
            with contextlib.suppress(Exception):  # cleanup: the install's own error is what is raised
                self._unwind()
            self._unwound = True
            raise
        self._closed = False

    def _install(self, poison: bool | str, ledger: bool | str, attempt: int) -> None:
        """Install step by step, each step's undo on the stack before the next step runs: a step that fails
        (the ledger's file, the stacks file) leaves nothing of the steps before it (no mode, no wrapper)."""
        from workbench.rank import agree
        from workbench.rank import poison as poison_mod

        stack = self._stack
        # the folder, its points file and the ledger (``rank/shard_files.py``): each undo on the stack as it opens
        files = shard_files.RankFiles(
            self.root, self.rank, stack, ledger=ledger, session=self.job or "", attempt=attempt,
            fault=None if self.strict else (lambda exc: self._fault("in the ledger's hook", exc, now=False)),
            before_destroy=lambda: self.fill_from_flight_recorder("before destroy_process_group"))
        self._points_file, self._ledger, self._calls, self._fr = files.points, files.ledger, files.calls, files.fr
        if files.fr is not None:
            self.doc["flight_recorder"] = True
        stack.callback(poison_mod.saved())  # to_empty and the poison state back as the capture found them
        poison_mod.reset_tracking()
        agree.forget()  # what an earlier capture in this process synced is not this run's
        poison_mod.set_poison(bool(poison))  # to_empty tracked either way (without poison: by fingerprint)
        self._poison = poison_mod
        if not self.strict:
            poison_mod.set_guest(lambda exc: self._fault("in the poison's hook", exc, now=False))
        if poison is True:  # also torch.empty and the other Python allocators: a function mode over every call
            self._poison_mode = poison_mod._Allocations()
            self._poison_mode.__enter__()
            stack.callback(self._leave_poison_mode)
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
        process.STATE.capture = self
        stack.callback(self._forget)
        debug_server.register()
        self._warm_when_cuda_starts()
        self._write_manifest()

    def _leave_poison_mode(self) -> None:
        from workbench.rank.ledger import leave_mode

        if not leave_mode(self._poison_mode, dispatch=False):
            self._poison_mode.off = True  # a mode the job pushed since sits above it: it stays, passing through

    def _forget(self) -> None:
        process.STATE.release("capture", self)

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

    # -- the guest's rule: the capture's own faults are one line, never the job's ----------------
    def _usable(self) -> bool:
        """Whether a call into the capture records: not once closed, nor once a fault stopped it (a hook's fault,
        said on another thread or inside a mode, is unwound here, on the job's own thread)."""
        if self.stopped is not None:
            self._stop()
            return False
        return not self._closed

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

            poison_mod.pause()
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
        with contextlib.suppress(Exception):  # cleanup after a fault, on the job's thread: nothing may reach the job
            self._unwind()
        self.doc.update(status="stopped", stopped=self.stopped)
        with contextlib.suppress(Exception):  # the shard marked stopped where it can be: a full disk must not raise
            self._write_manifest()

    @_takes()
    def close(self) -> None:
        """Stop recording and poisoning; the shard says the rank finished (unless it raised). A fault here is one
        line on stderr (``guest.py``)."""
        if not self._usable():
            return
        try:
            self.flush()
            self.fill_from_flight_recorder("at close")  # a fault of its own is its own line; the close goes on
            # The fused probe's kernel still building when a short job ends is not left mid-build at interpreter
            # exit; bounded, since a build queued behind a stuck collective never ends.
            from workbench.rank import probe_fused

            probe_fused.settle_warm(WARM_AT_CLOSE_S)
            self._closed = self._unwound = True
            if self.watch is not None:
                self.watch.end()
            with contextlib.suppress(Exception):  # a note of the close's, never a reason to lose the close
                if held := teardown.outlived(self, "_world_pg"):  # before the unwind drops the capture's reference
                    self.doc["group_outlived"] = held
            self._unwind()
            if self.doc["status"] == "running":
                self.doc["status"] = "finished"
            hooks = getattr(self, "hooks", None)  # the automatic points (``workbench job``): how far they followed
            if hooks is not None and "step" in hooks.points:
                self.doc["followed"] = hooks.followed()
            self._write_manifest()
        except Exception as exc:  # the boundary: a fault of the close is one line (guest.py), never the job's
            if self.strict:
                raise
            self._fault("at close", exc)  # before the unwind: it unwinds; after it: the line below
            with contextlib.suppress(Exception):  # cleanup goes on: whatever the failed step left
                self._unwind()

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Capture rank {self.rank}/{self.world_size} job {self.job} -> {self.dir}: {len(self.points)} point(s)>"



WARM_AT_CLOSE_S = 20.0




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
