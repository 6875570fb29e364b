"""``cap.breakpoint()``: every rank of the user's own job serves as an ipyparallel engine, then goes on.

At a breakpoint (every rank calls it at the same point of the script) rank 0 starts an
``ipcontroller`` (loopback when the job runs on one host, else the job's own ``MASTER_ADDR``;
or the user names one: ``controller=<ipcontroller-engine.json>``), the engine file goes to the
other ranks through the job's own store, and every rank runs ipyparallel's own engine
(``IPEngine``) on its main thread, with the job's process group as it is and a namespace
holding the capture, the objects passed to the capture's last point and to the breakpoint.
``<dir>/attach.json`` says where a client finds the controller (``wb.connect(job=dir)``).

The way back: the engine's loop runs a coroutine of ours (register, then wait for a stop
event), not ``IPEngine.start``'s loop that never ends; a client's ``resume`` sets the event
(after the reply has left), the deadline sets it too, and ``breakpoint`` returns to the script.
The engine's output redirection, display hook, ``__main__`` and singletons are undone; the
engine installs no signal handlers here (the launcher's SIGTERM still ends the rank) and leaves
the job's file descriptors alone. Rank 0 waits (through the job's store, no collective) until
every rank's engine has stopped, stops the controller and marks ``attach.json`` resumed.

The deadline wins over a cell that never returns (``_Watchdog``): the cell is interrupted with
``KeyboardInterrupt`` and the rank goes on; only a cell stuck inside a C call that never comes back to
Python (a collective nobody joins) outlasts it, said on stderr and in ``attach.json``. ``attach()`` is
the part a breakpoint shares with the post mortem (``triggers.py``: the same engines, served after
an exception or a proven deadlock, from a watcher thread on the ranks stuck in a collective).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from workbench.job import guest, keys, process

ATTACH = "attach.json"


@dataclass
class Serving:
    """The attach in progress on a rank (a breakpoint, or the post mortem), held by its capture
    (``Capture.serving``) while it serves: what the engine's remote calls (``here``, ``whoami``, ``resume``),
    the cell tracker and the deadline's watchdog share."""

    ident: int | str  # a breakpoint's number, or "post-mortem"
    ns: dict[str, Any]  # the engine's namespace
    names: list[str] = field(default_factory=list)  # what the namespace offers a notebook (``shown_names``)
    by: str = "deadline"  # how it ends: "client" once resumed
    loop: Any = None  # the engine's event loop, once it runs
    event: Any = None  # the stop event on that loop
    busy: float | None = None  # time.monotonic() since a client's cell runs; None between cells


class Host(Protocol):
    """What an attach reads of the capture it serves (``shard.Capture``), and nothing else."""

    rank: int
    world_size: int
    root: Path
    job: str | None
    points: list[str]
    serving: Serving | None  # the attach sets it while it serves

    @property
    def attempt(self) -> int: ...  # the launcher's restart count: its keys in the job's store

    @property
    def objects(self) -> dict[str, Any]: ...  # the last point's objects

    @property
    def device(self) -> Any: ...  # the rank's device, as its last point saw it

    @property
    def latest(self) -> dict[str, Any] | None: ...  # the last point's record (its rows)

    @property
    def device_held(self) -> str | None: ...  # why the post mortem could not free its device, where it could not


# A fact of the process, not of one capture: a breakpoint's keys in the job's store outlive the capture that set
# them (so breakpoints are numbered across the process's captures). The capture serving now is
# ``process.STATE.served``: the engine is a singleton of the process, and the remote calls find it there.
_BREAKPOINTS = itertools.count()


def _serving() -> Serving | None:
    host = process.STATE.served
    return host.serving if host is not None else None


def here() -> dict[str, Any]:
    """The namespace of the breakpoint this rank is in (what ``%%px`` cells see): for ``cluster.run``."""
    now = _serving()
    if now is None:
        raise RuntimeError("this process is not at a workbench breakpoint")
    return now.ns


def whoami() -> dict[str, Any]:
    """The engine's place in the job (the client orders engines by it)."""
    import torch.distributed as dist

    from workbench.job.launcher import launcher_env

    host = process.STATE.served
    now = _serving()
    init = dist.is_available() and dist.is_initialized()
    return {"rank": dist.get_rank() if init else host.rank if host else 0,
            "world_size": dist.get_world_size() if init else host.world_size if host else 1,
            "backend": dist.get_backend() if init else "", "pid": os.getpid(), "host": socket.gethostname(),
            "local_rank": launcher_env()["local_rank"], "names": now.names if now else [],
            "job": host.job if host else None, "breakpoint": now.ident if now else None,
            "control": _control()}


def _control() -> dict[str, Any] | None:
    """The rank's control thread (``rank/control.py``: Python stacks while a cell hangs), started when a client
    first attaches, once per process: on loopback when the job is on one host, else on this host's address
    toward the job's ``MASTER_ADDR``; every request carries its token."""
    from workbench.job.launcher import launcher_env
    from workbench.rank import control

    try:
        ip = _controller_ip()
        return control.start(ip, launcher_env()["master_port"] if ip != "127.0.0.1" else 0)
    except (OSError, ValueError) as exc:  # no socket to bind, a launcher variable that is not a number
        guest.say(f"workbench: this rank's control thread did not start ({guest.cause(exc)}); a notebook sees no "
                  "Python stacks of a cell that hangs")
        return None


def resume(delay: float = 0.2) -> bool:
    """Called on the engine by ``cluster.resume()``: the breakpoint returns once this reply has left."""
    now = _serving()
    if now is None or now.loop is None or now.event is None:
        return False
    now.by = "client"
    now.loop.call_later(delay, now.event.set)
    return True


def _controller_ip() -> str:
    """Loopback when the whole job is on this host (as ``launcher_env`` reads it: torchrun's or srun's own
    variables), else the job's own rendezvous address (this host's where the job names none)."""
    from workbench.job.launcher import launcher_env, one_host

    where = launcher_env()
    if one_host(where):
        return "127.0.0.1"
    addr = where["master_addr"] or socket.gethostname()
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return addr


def _start_controller(folder: Path, cluster_id: str, timeout: float = 120.0) -> tuple[subprocess.Popen, Path, Path]:
    pdir = folder / "ipython"
    sec = pdir / "security"
    for f in (sec / f"ipcontroller-{cluster_id}-engine.json", sec / f"ipcontroller-{cluster_id}-client.json"):
        f.unlink(missing_ok=True)
    pdir.mkdir(parents=True, exist_ok=True)
    log = open(folder / "controller.log", "ab")
    proc = subprocess.Popen([sys.executable, "-c", _CONTROLLER, str(os.getpid()), f"--profile-dir={pdir}",
                             f"--cluster-id={cluster_id}", f"--ip={_controller_ip()}", "--ping=500",
                             "--log-level=WARN"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # not the rank's process group: torchrun's killpg of a rank
    # (after another rank died) would end the post mortem's controller while its rank still serves; rank 0's
    # death still ends it (PR_SET_PDEATHSIG, below)
    log.close()
    engine_file = sec / f"ipcontroller-{cluster_id}-engine.json"
    client_file = sec / f"ipcontroller-{cluster_id}-client.json"
    end = time.monotonic() + timeout
    while not (engine_file.exists() and client_file.exists()):
        if proc.poll() is not None or time.monotonic() > end:
            _stop_controller(proc)
            raise RuntimeError(f"the breakpoint's ipcontroller did not start (see {folder / 'controller.log'})")
        time.sleep(0.05)
    time.sleep(0.05)  # the files are written whole before the controller answers; a moment more
    return proc, engine_file, client_file


# The controller's own first lines: SIGTERM when rank 0 dies (PR_SET_PDEATHSIG: a killed job leaves no
# controller), set in the child itself rather than through preexec_fn (not safe in a job with threads). A fork
# does not inherit that setting, so the schedulers ipcontroller forks get their own (SIGKILL when the controller
# goes): seen on a loaded box, a controller ended by its parent's death left its schedulers running for good.
_CONTROLLER = """import ctypes, os, runpy, signal, sys
try:
    _libc = ctypes.CDLL(None)
    _libc.prctl(1, int(signal.SIGTERM))
    os.register_at_fork(after_in_child=lambda: _libc.prctl(1, int(signal.SIGKILL)))
except (OSError, AttributeError):  # no libc to load, no prctl (not Linux): the controller runs without the check
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
sys.argv = ["ipcontroller", *sys.argv[2:]]
runpy.run_module("ipyparallel.controller", run_name="__main__", alter_sys=True)
"""


def _stop_controller(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    # its schedulers are its children and go with it; a straggler is ended by its own parent-death check


def _write(path: Path, doc: dict[str, Any]) -> None:
    """``attach.json`` by rename (the shard format's atomic write): a notebook never reads half of it."""
    from workbench.rank import shard_format

    shard_format.write_json_atomic(path, doc, indent=1)


def job_store() -> Any:
    """The job's own store (its default group's), or None: no process group, or a group of one (no one to tell).
    What the breakpoint and the post mortem share their keys through, never a collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


def _share(key: str, value: str | None, rank: int, timeout: float) -> str:
    """Rank 0's value to every rank through the job's own store (none without a process group)."""
    import datetime

    store = job_store()
    if store is None:
        return value or ""
    if rank == 0:
        store.set(key, value or "")
        return value or ""
    store.wait([key], datetime.timedelta(seconds=timeout))
    return store.get(key).decode()


def _all_done(key: keys.Attach, rank: int, timeout: float, root: Any = None) -> None:
    """Rank 0 waits, through the job's store (no collective: the job's group and ledger see nothing), until
    every rank's engine has stopped serving, before it stops the controller the others still talk to. A rank
    whose shard (under ``root``) says it is dead is not waited for; one that does not answer in ``timeout``
    seconds, or a store that fails, is one line on stderr."""
    import torch.distributed as dist

    store = job_store()
    if store is None:
        return
    try:
        store.set(key.done(rank), "1")
        if rank != 0:
            return
        waiting = set(range(dist.get_world_size())) - {0}
        end = time.monotonic() + timeout
        while waiting and time.monotonic() < end:
            waiting = {r for r in waiting if not store.check([key.done(r)]) and not _gone(root, r)}
            if waiting:
                time.sleep(0.1)
        if waiting:
            guest.say(f"workbench: rank {rank}: {'rank' if len(waiting) == 1 else 'ranks'} "
                 f"{','.join(map(str, sorted(waiting)))} did not say their engines stopped in {timeout:g}s; the "
                 "breakpoint's controller stops now")
    except RuntimeError as exc:  # the store's own errors (DistStoreError, DistError: a timeout, a store gone)
        guest.say(f"workbench: rank {rank}: the breakpoint's end could not be agreed through the job's store "
             f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); going on")


def _gone(root: Any, rank: int) -> bool:
    """Whether rank ``rank``'s shard under ``root`` ends without a close and its process is gone."""
    from workbench.rank import shard_format

    if root is None:
        return False
    try:
        return shard_format.gone(json.loads((shard_format.rank_dir(root, rank) / shard_format.MANIFEST).read_text()))
    except (OSError, ValueError, AttributeError):
        return False


def serve(cap: Host, *, deadline: float = 600.0, controller: str | os.PathLike | None = None,
          **objects: Any) -> dict[str, Any]:
    """Serve this rank as an ipyparallel engine until a client resumes it or ``deadline`` seconds pass.

    Call it on every rank at the same point. ``objects`` (and the capture's last point's objects, the
    capture as ``cap``) are the engine's namespace: ``cluster.probe("model")``, ``%%px`` cells, and
    ``workbench.job.engine.here()`` inside ``cluster.run`` functions. Returns how it ended:
    ``{"by": "client" | "deadline", "seconds": ..., "attach_s": ...}``.
    """
    n = next(_BREAKPOINTS)
    return attach(cap, n, keys.breakpoint(cap.attempt, n), f"bp{n}", deadline=deadline,
                  controller=controller, objects=objects)


def attach(cap: Host, ident: int | str, key: keys.Attach, cluster_id: str, *, deadline: float,
           controller: str | os.PathLike | None = None, objects: dict[str, Any] | None = None,
           doc: Any = None, on_stuck: Any = None) -> dict[str, Any]:
    """Every rank serves as an engine of one controller (rank 0 starts it) until resumed or the deadline.

    ``ident`` names this attach in ``attach.json`` and in each engine's ``whoami`` (a breakpoint's number,
    or ``"post-mortem"``); ``key`` prefixes its keys in the job's store; ``doc()`` (rank 0) adds to
    ``attach.json``. Rank 0 sets ``<key>/closed`` once the controller is stopped and ``attach.json`` says
    resumed (a rank that then exits may have the launcher end the rest). ``on_stuck()`` runs (on another
    thread) when a cell outlasts the deadline and its interrupt: the post mortem's raising rank exits there."""
    objects = objects or {}
    rank, world, root = cap.rank, cap.world_size, Path(cap.root)
    t0 = time.time()
    folder = root / "attach"
    proc = None
    info = ""
    if rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if controller is not None:
                engine_file = Path(controller).resolve()
                client_file = Path(str(engine_file).replace("-engine.json", "-client.json"))
            else:
                proc, engine_file, client_file = _start_controller(folder, cluster_id)
            info = json.dumps({"engine": engine_file.read_text(), "client_file": str(client_file.resolve())})
        except Exception as exc:  # broad: the other ranks wait on this key, so whatever fails must reach them
            info = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    got = json.loads(_share(key.info, info, rank, timeout=keys.INFO_WAIT_S + deadline))
    if "error" in got:  # rank 0 says it, once for the job; every rank goes on
        if rank == 0:
            guest.say(f"workbench: rank 0: no {'post mortem' if ident == 'post-mortem' else 'breakpoint'}: the "
                      f"controller did not start ({got['error']}); every rank goes on")
        return {"by": "error", "error": got["error"], "seconds": time.time() - t0, "attach_s": None}
    ns = _namespace(cap, objects)
    if rank == 0:
        extra: dict[str, Any] = {}
        if doc is not None:
            try:
                extra = doc()
            except Exception as exc:  # broad: the caller's account (triggers); attach.json goes out without it, said
                guest.say(f"workbench: rank 0: attach.json lacks its account ({guest.cause(exc)})")
        _write(root / ATTACH, {
            "status": "waiting", "breakpoint": ident, "kind": "breakpoint" if isinstance(ident, int) else ident,
            "job": cap.job, "world_size": world,
            "client_file": got["client_file"], "controller_pid": proc.pid if proc else None,
            "point": (cap.points or [None])[-1], "names": shown_names(ns),
            "started_at": t0, "deadline_at": t0 + deadline, "host": socket.gethostname(), "pid": os.getpid(),
            "ready_s": time.time() - t0, **extra})
    try:
        result = _serve(cap, Serving(ident, ns, shown_names(ns)), got["engine"], deadline, on_stuck)
        _all_done(key, rank, timeout=keys.DONE_WAIT_S, root=root)
    finally:  # however the serving ended (an interrupt too), rank 0 stops its controller
        if rank == 0:
            _stop_controller(proc)
    if rank == 0:
        with contextlib.suppress(OSError, ValueError):  # attach.json unreadable or not JSON: it stays "waiting"
            doc_now = json.loads((root / ATTACH).read_text())
            doc_now.update(status="resumed", by=result["by"], resumed_at=time.time(), seconds=result["seconds"])
            if result.get("hung"):
                doc_now["hung"] = result["hung"]
            _write(root / ATTACH, doc_now)
        _share(key.closed, "1", rank, timeout=0)
    result["total_s"] = time.time() - t0
    return result


def shown_names(ns: dict[str, Any]) -> list[str]:
    """The names a rank's namespace offers a notebook, sorted: a script's module dunders (``__name__``,
    ``__builtins__``, ... where the frame that waits is the script's top level) left out."""
    return sorted(n for n in ns if not (n.startswith("__") and n.endswith("__")))


def probe_here(names: list[str]) -> dict[str, Any]:
    """This rank's probe rows for ``names`` now (``cluster.probe`` on a job): ``{"rows": [...]}``. Where the rank
    cannot read them (its device still held behind a collective that never completes), the rows its shard holds
    from its last point, each labelled ``as of point X`` (``as_of``), with why; ``{"error": ...}`` where it has
    neither."""
    from workbench.rank import phases

    ns = here()
    host = process.STATE.served
    objects = {n: ns[n] for n in names if n in ns}
    held = host.device_held
    try:
        if held:  # the post mortem could not free this rank's device: asking it would wait for good
            raise TimeoutError(f"its device is held behind a collective that never completes ({held})")
        return {"rows": phases.probe_rows(objects)}
    except Exception as exc:  # broad: a client's request; whatever the probe raised is its answer's ``why``
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    latest = host.latest or {}
    rows = [dict(r, as_of=f"point {latest.get('point')}") for r in latest.get("tensors") or []
            if str(r.get("name", "")).split(".")[0] in names]
    if not rows:
        return {"error": why}
    return {"rows": rows, "as_of": latest.get("point"), "why": why}


def _namespace(cap: Host, objects: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ns: dict[str, Any] = {"torch": torch, "dist": dist, "cap": cap, "rank": cap.rank, "world_size": cap.world_size}
    ns.update(cap.objects)
    ns.update(objects)
    return ns


def _serve(cap: Host, now: Serving, engine_json: str, deadline: float, on_stuck: Any = None) -> dict[str, Any]:
    """Run ipyparallel's engine on this thread until ``resume`` or the deadline; undo what it changed."""
    import asyncio

    from ipyparallel.engine.app import IPEngine

    # the engine's own files sit in the capture's folder, not in the temp dir: a rank the launcher kills at the
    # breakpoint (SIGTERM, no ``finally``) leaves nothing in TMPDIR (a ``wb-bp-*`` folder there before)
    tmp = Path(cap.root) / "attach" / f"engine-rank{cap.rank}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "profile").mkdir(parents=True)
    (tmp / "engine.json").write_text(engine_json)
    saved = {"stdout": sys.stdout, "stderr": sys.stderr, "displayhook": sys.displayhook,
             "main": sys.modules.get("__main__"), "path": list(sys.path)}
    ns = now.ns
    cap.serving = now
    process.STATE.served = cap
    from workbench.rank import context

    fill_rank = not context.rank_is_set()  # what %%px cells' ``wbr.here()`` reads, where no live group set it
    if fill_rank:
        context.set_rank(cap.rank, cap.world_size, ns["dist"].get_backend() if ns["dist"].is_initialized() else "",
                         cap.device, deadline)
    import threading

    t0 = time.perf_counter()
    out: dict[str, Any] = {"by": "deadline", "attach_s": None}
    engine = None
    watchdog = None
    threads_before = set(threading.enumerate())
    try:
        engine = IPEngine.instance()
        engine.user_ns = ns
        engine.init_signal = lambda: None  # the launcher's SIGTERM keeps ending the rank
        engine.out_stream_factory = _out_stream()  # cells' prints go to the client; the job's own fds stay its own
        engine.initialize([f"--file={tmp / 'engine.json'}", "--IPEngine.enable_nanny=False",
                           f"--IPEngine.id={int(cap.rank)}",  # %%px output labelled by the rank
                           f"--profile-dir={tmp / 'profile'}", "--log-level=ERROR", "--IPEngine.timeout=60"])

        async def main() -> None:
            event = asyncio.Event()
            now.loop, now.event = asyncio.get_running_loop(), event
            await engine.register()
            _track_cells(engine.kernel, now)
            out["attach_s"] = time.perf_counter() - t0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), max(0.0, deadline - (time.perf_counter() - t0)))
            out["by"] = now.by if event.is_set() else "deadline"

        watchdog = _Watchdog(t0 + deadline, out, now, on_stuck)
        engine.loop.run_sync(main)
    except SystemExit as exc:  # the engine's own registration timeout calls sys.exit
        out.update(by="error", error=f"the engine exited ({exc.code}) before a client attached")
    except RuntimeError as exc:  # the engine stopped its loop itself (its controller's heartbeats stopped)
        out.update(by="error", error=f"the engine stopped: {exc}")
    except KeyboardInterrupt:  # the deadline's interrupt landed between a cell's end and the kernel's hook
        if not out.get("hung"):
            raise
        out["by"] = "deadline"
    finally:
        if watchdog is not None:
            watchdog.stop()
        for stream in (sys.stdout, sys.stderr):
            if stream is not saved["stdout"] and stream is not saved["stderr"]:
                _quietly(stream.flush, stream.close)
        sys.stdout, sys.stderr, sys.displayhook = saved["stdout"], saved["stderr"], saved["displayhook"]
        if saved["main"] is not None:
            sys.modules["__main__"] = saved["main"]
        sys.path[:] = saved["path"]
        _teardown(engine)
        if engine is not None and threading.current_thread() is not threading.main_thread():
            # the event loop IOLoop.current() made for this thread
            _quietly(engine.loop.close, lambda: asyncio.set_event_loop(None))
        _end_heart(set(threading.enumerate()) - threads_before)
        if fill_rank:
            context.clear_rank()
        cap.serving = None
        process.STATE.served = None
        shutil.rmtree(tmp, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def _track_cells(kernel: Any, now: Serving) -> None:
    """Mark while the kernel runs a client's request (a ``%%px`` cell, a ``cluster.run`` function): what the
    deadline's watchdog interrupts. The kernel's own SIGINT hook stays (it raises on a thread that is not the
    main one, and the kernel logs and ignores that)."""
    pre, post = kernel.pre_handler_hook, kernel.post_handler_hook

    def pre_hook() -> None:
        now.busy = time.monotonic()
        pre()

    def post_hook() -> None:
        now.busy = None
        post()

    kernel.pre_handler_hook, kernel.post_handler_hook = pre_hook, post_hook


class _Watchdog:
    """The deadline wins over a cell that never returns: the engine's loop runs the cells on the serving thread,
    so a hung cell would hold the breakpoint past its deadline. At the deadline, while a cell still runs, this
    thread raises ``KeyboardInterrupt`` into it (asynchronously, and on the main thread also by SIGINT, which
    ends a blocking ``time.sleep`` or socket wait there); the cell fails with it, the loop sees the deadline and
    the rank goes on. A cell blocked inside a C call that never returns to Python (a collective the other ranks
    never join) cannot be interrupted: one line on stderr says so, and ``attach.json`` records it."""

    GRACE_S = 10.0

    def __init__(self, at: float, out: dict[str, Any], now: Serving, on_stuck: Any = None) -> None:
        import threading

        self.at, self.out, self.now, self.on_stuck = at, out, now, on_stuck  # ``at``: time.perf_counter()
        self.target = threading.get_ident()
        self.main = threading.current_thread() is threading.main_thread()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="workbench-deadline", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import ctypes
        import signal

        if self.done.wait(max(0.0, self.at - time.perf_counter())):
            return
        tries, end = 0, time.perf_counter() + self.GRACE_S
        while not self.done.is_set() and (busy := self.now.busy) is not None:
            if tries == 0:
                self.out["hung"] = {"cell_s": round(time.monotonic() - busy, 2)}
                loop, event = self.now.loop, self.now.event
                if loop is not None and event is not None:
                    self.now.by = "deadline"
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(event.set)
                if not self.main:  # a thread takes it at its next bytecode (not inside a blocking C call)
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.target),
                                                               ctypes.py_object(KeyboardInterrupt))
            if self.main:  # a signal also ends a blocking sleep or socket wait; its handler raises the interrupt
                with contextlib.suppress(OSError):  # the thread is gone
                    signal.pthread_kill(self.target, signal.SIGINT)
            tries += 1
            if time.perf_counter() > end:
                self.out["hung"]["interrupted"] = False
                guest.say(f"workbench: a notebook's cell still runs {self.GRACE_S:g}s past the breakpoint's deadline "
                          "and cannot be interrupted (blocked in C: a collective?); "
                          + ("this rank fails now, as it would have" if self.on_stuck is not None else
                             "this rank goes on when it returns"))
                if self.on_stuck is not None:
                    self.on_stuck()
                return
            self.done.wait(0.5)
        if "hung" in self.out:
            self.out["hung"].setdefault("interrupted", True)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(2.0)
        if self.thread.is_alive():
            return
        # an interrupt set but not yet taken would land in the script: clear it
        import ctypes

        if self.out.get("hung") and not self.main:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.target), None)


def _out_stream() -> type:
    """ipykernel's ``OutStream`` without its fd capture: that moves fd 1 and 2 onto a pipe for good (the
    job's own output after the breakpoint vanished, measured), and would swallow the C-level logs of the
    job's threads while it waits."""
    from ipykernel.iostream import OutStream

    class JobOutStream(OutStream):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["watchfd"] = False
            super().__init__(*args, **kwargs)

    return JobOutStream


def _end_heart(threads: set) -> None:
    """The engine's heartbeat runs as a zmq device thread on a context of its own, held nowhere: ending that
    context ends the thread (it closes its sockets on ETERM); else each breakpoint left one thread behind."""
    import threading

    from zmq.devices import Device

    for t in threads:
        dev = getattr(getattr(t, "_target", None), "__self__", None)
        ctx = getattr(dev, "_context", None)
        if isinstance(dev, Device) and ctx is not None:
            ender = threading.Thread(target=ctx.term, daemon=True, name="wb-end-heart")
            ender.start()
            ender.join(2.0)
            t.join(2.0)


def _quietly(*steps: Any) -> None:
    """Run each cleanup step whatever the one before raised: the engine's sockets, threads, streams and singletons
    go one by one, and a step that fails (a socket closed already, an attribute this ipyparallel lacks) must not
    keep the next from running, nor reach the job."""
    for step in steps:
        try:
            step()
        except Exception:  # broad: cleanup of third-party objects (zmq, tornado, ipykernel), half torn down already
            pass


def _teardown(engine: Any) -> None:
    """Close the engine's sockets and threads and forget its singletons, so a later breakpoint starts fresh."""
    from ipykernel.kernelapp import IPKernelApp
    from ipyparallel.engine.app import IPEngine
    from ipyparallel.engine.kernel import IPythonParallelKernel
    from IPython.core.interactiveshell import InteractiveShell

    if engine is None:
        return
    kernel = getattr(engine, "kernel", None)  # None before the engine made one: its steps fail, the rest run
    _quietly(lambda: engine.session.send(engine.registrar, "unregistration_request", content={"id": engine.id}),
             lambda: engine._hb_reporter.stop(),
             lambda: kernel.control_thread.stop(), lambda: kernel.iopub_socket.stop(),
             lambda: kernel.shell_stream.close(), lambda: kernel.control_stream.close(),
             *(lambda attr=attr: getattr(engine, attr).close(linger=0)
               for attr in ("_hb_listener", "registrar", "shell_socket", "control_socket")),
             InteractiveShell.clear_instance,
             *(cls.clear_instance for cls in (IPythonParallelKernel, IPKernelApp, IPEngine)))
