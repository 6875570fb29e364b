"""Engines: ipyparallel engines holding one torch.distributed process group.

Rank = engine order. The group forms over a TCP store on 127.0.0.1 with a free port.
Every call collects per-rank outcomes under a deadline, so a stuck collective or a dead
engine becomes a per-rank failure the caller can show, never a hung notebook kernel.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil

from workbench.errors import LOST, ClusterError, RankErrors, RankFailure
from workbench.live import lease as live_lease
from workbench.rank import leftovers, stacks
from workbench.rank.host import free_port, gpu_count, set_threads
from workbench.rank.warmup import import_rank_layer as _import_rank_layer  # shipped to engines by name

ABORT_WAIT_S = 5.0  # how long aborted ranks get to come back before the old path (timeout, restart)
DEATH_GRACE_S = 3.0  # how long the survivors get to notice a dead peer
WATCH_EVERY_S = 0.1  # how often a running step's ledgers are read for a deadlock
SLOW_GRACE = 5.0  # ranks busy outside any collective at the deadline are slow, not hung: up to this many deadlines
# The hub only counts an engine as registered once its heart answers a ping; at the default
# 3 s period that alone cost ~5 s of every cold start (6.7 s -> 2.2 s measured at 500 ms).
# Ten missed pings (5 s) still mark an engine dead; the heart runs outside the GIL, so a rank
# blocked in a collective keeps beating.
CONTROLLER_ARGS = ["--ping=500"]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def resolve_backend(backend: str, ranks: int) -> str:
    """'auto' means NCCL with one GPU per rank when there are enough GPUs, else gloo."""
    if ranks < 1:
        raise ClusterError(f"ranks must be >= 1, got {ranks}")
    if backend not in ("auto", "gloo", "nccl"):
        raise ClusterError(f"unknown backend {backend!r}; valid: auto, gloo, nccl")
    if backend == "gloo":
        return backend  # no GPU count needed: a client asking for gloo (or attaching) never imports torch
    gpus = gpu_count()
    if backend == "nccl" and gpus < ranks:
        raise ClusterError(f"backend 'nccl' needs one GPU per rank: {ranks} ranks asked, {gpus} GPU(s) visible")
    if backend == "auto":
        return "nccl" if gpus >= ranks else "gloo"
    return backend


def check_timeout_port(timeout: float, port: int | None) -> None:
    """A collective timeout must be a positive number of seconds; a port 1..65535 (None: a free one)."""
    try:
        ok = float(timeout) > 0 and math.isfinite(float(timeout))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ClusterError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ClusterError(f"port must be an integer 1..65535 (or None for a free one), got {port!r}")


@dataclass
class Outcome:
    """Per-rank values and failures of one call."""

    values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)

    def raise_for_failures(self) -> None:
        if self.failures:
            raise RankErrors(self.failures, self.values)


def _port_taken(failure: RankFailure | None) -> bool:
    """Rank 0 could not bind the store's port: someone took it after it was picked."""
    return failure is not None and failure.kind == "error" and (
        "Address already in use" in failure.message or "EADDRINUSE" in failure.message)


ANSWER_S = 120.0  # an engine's first answers after it registered (torch's import on a loaded 2-core box: ~10 s)


def first_answers(view: Any, fn: Callable[[], Any], what: str) -> list[Any]:
    """``fn()`` on every engine of ``view``, in its order, awaited ``ANSWER_S`` at most.

    An engine counts as registered once its heart beats, and the heart has a thread of its own: an engine whose
    main loop is stuck (a profile's start-up line that blocks, a stopped or swapping process) registers all the
    same and then never answers. A plain ``apply_sync`` waited on it for ever; this names it."""
    ar = view.apply_async(fn)
    if not ar.wait(ANSWER_S):
        silent = [e for e, m in zip(view.targets, ar.msg_ids) if m in view.client.outstanding]
        raise ClusterError(f"engine{'s' if len(silent) != 1 else ''} {', '.join(map(str, silent))} registered but "
                           f"did not answer (asked for {what}) within {ANSWER_S:g} s: its main loop is blocked "
                           "(a start-up line in the profile's ipengine_config.py, a stopped or swapping process)")
    return ar.get(0)


class Engines:
    """N engines, one rank each, and the process group among them.

    Knows nothing of sessions or scenarios: it runs functions on ranks and keeps the
    ranks usable. ``Cluster`` (live/cluster.py) is the notebook-facing desk on top.
    """

    def __init__(self, ranks: int = 2, backend: str = "auto", timeout: float = 60.0,
                 port: int | None = None, env: dict[str, str] | None = None):
        check_timeout_port(timeout, port)  # before any engine starts: a bad value is one line, not 10 s later
        # This client's own temp dirs (sessions' ledger dirs) go at its exit, or with the next sweep once it is
        # killed (rank/leftovers.py); ranks list theirs the same way. The sweep: what dead ones left here (a killed
        # attached run starts no engine whose sweep would find it).
        leftovers.own_temp_paths()
        stacks.sweep_stale()
        self.backend = resolve_backend(backend, ranks)
        self.world_size = ranks
        self.timeout = float(timeout)
        self._port_wish = port
        self.port: int | None = None
        self.env = dict(env or {})
        self._ipp = None
        self._client = None
        self._lease: live_lease.Lease | None = None  # the processes this client started, ended with it
        self._ids: list[int] = []
        self.pids: dict[int, int] = {}
        self.devices: dict[int, str] = {}
        self.controls: dict[int, dict[str, Any] | None] = {}  # rank -> its control thread (host, port, token)
        self.kernels: dict[int, dict[str, str]] = {}  # rank -> the knobs that picked its float kernels
        self.local_index: dict[int, int] = {}  # rank -> index on its host (GPU); empty: the rank itself
        self.master_addr = "127.0.0.1"
        self._busy: dict[int, Any] = {}  # rank -> AsyncResult still running after its deadline
        self._dead: set[int] = set()
        self.dirty = False  # a step failed: the group may hold mispaired messages
        self.generation = 0  # bumped whenever the group (and every rank's session state) is re-formed
        self.step_deadline: float | None = None  # a session step's deadline; None: self.deadline
        # Declare a deadlock as soon as the ledgers prove it (analysis/deadlock.py), on every backend, and
        # release only the calls that can never complete (live/release.py): ranks that are not stuck finish
        # the step as they would have. False: wait for the collective timeout or the step deadline instead.
        self.detect_deadlocks: bool = True
        self.recoveries: list[dict[str, Any]] = []
        self.start_s: float | None = None
        self.group_s: float | None = None
        self.imports_s: float | None = None  # engines importing torch and the rank layer, before the group
        self.start_retries: list[str] = []  # why a start-up was tried again (an engine set that stopped early)

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> Engines:
        """Start the engines and form the group; interrupted or failed anywhere, no engine survives.

        ipyparallel picks its ports before it binds them, so an engine set can stop during start-up because
        another process (another notebook, a parallel test lane) took a port in between: that start is tried
        once more, on fresh ports, after the half-started cluster is stopped. Twice, and the one line names
        what the logs say stopped it (the port in use)."""
        started = None
        try:
            try:
                started = self._start()
            except _StoppedEarly as first:
                self.stop()
                self.pids = {}
                self.start_retries.append(first.cause)
                try:
                    started = self._start()
                    warnings.warn(f"the engines' start-up was tried again on fresh ports: {first.cause}", stacklevel=2)
                except _StoppedEarly as second:
                    before = "" if second.cause == first.cause else f"; the first time: {first.cause}"
                    raise ClusterError(f"could not start {self.world_size} engines: {second.cause} "
                                       f"(tried twice, on fresh ports{before})") from None
        finally:
            if started is None:  # whatever stopped it, Ctrl-C / SIGTERM while engines come up included
                self.stop()
        return started

    def _start(self) -> Engines:
        import ipyparallel as ipp

        from workbench.live import engine_fork  # imports ipyparallel's launchers: not at the client's import

        t0 = time.perf_counter()
        # Before any process starts: a client killed from here on takes everything it started along.
        self._lease = live_lease.Lease().start()
        env = {**self.env, **self._lease.env}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            # ERROR, not WARNING: an engine that died in start-up is named in our one line (``_stop_cause``), not
            # as ipyparallel's dump of its log, traceback included.
            self._ipp = ipp.Cluster(n=self.world_size, log_level=logging.ERROR, controller_args=CONTROLLER_ARGS,
                                    **engine_fork.cluster_kwargs())
            self._client = self._ipp.start_and_connect_sync()
            self._client.wait_for_engines(self.world_size, timeout=120)
        except ipp_faults() as exc:
            cause = _stop_cause(self._ipp) if _stopped_early(exc) else None  # the logs, read before stop() drops them
            self.stop()
            if cause is not None:
                raise _StoppedEarly(cause) from exc
            raise ClusterError(f"could not start {self.world_size} engines: {exc}") from exc
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._ids = sorted(self._client.ids)[: self.world_size]
        view = self._client[self._ids]
        view.use_cloudpickle()
        self.pids = dict(enumerate(first_answers(view, os.getpid, "its pid")))
        self.start_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        first_answers(view, _import_rank_layer, "the rank layer's import")  # timed apart from the group's forming
        self.imports_s = time.perf_counter() - t1
        formed = False
        try:
            self.form_group()
            formed = True
        finally:
            if not formed:
                self.stop()  # whatever stopped it, the caller never gets this object: leave no engine behind
        return self

    def form_group(self, _again: bool = True) -> None:
        """(Re-)form the process group on every engine with a fresh port (see ``_rendezvous``).

        The port is picked free and bound by rank 0 a moment later; another process (a second notebook, a parallel
        test lane) can take it in between. Rank 0 then cannot bind it and the others may reach that process's own
        store: the group is formed once more on a fresh port, with a warning."""
        from workbench.rank.byname import RankFn

        # By name: importing rank.context here would import torch into the client (~1.5 s of every attached run).
        destroy_rank, init_rank = (RankFn("workbench.rank.context", n) for n in ("destroy_rank", "init_rank"))

        if self.dirty or self.port is not None:
            self.call(destroy_rank, timeout=self.timeout + 10)
        addr, port = self._rendezvous()
        t0 = time.perf_counter()
        pending = {r: self._view(r).apply_async(init_rank, r, self.world_size, self.backend, port, self.timeout,
                                                addr, self.local_index.get(r))
                   for r in range(self.world_size)}
        outcome = self._collect(pending, self.timeout + 30)
        if outcome.failures and _again and _port_taken(outcome.failures.get(0)):
            self.dirty = True  # whatever a rank's half-made group holds is destroyed first
            warnings.warn(f"port {port} was taken before rank 0's store could bind it; the process group forms on a "
                          "fresh port", stacklevel=2)
            return self.form_group(_again=False)
        if outcome.failures:
            raise ClusterError("process group did not form:\n  " +
                               "\n  ".join(f.line() for f in outcome.failures.values()))
        self.port, self.master_addr = port, addr
        self.dirty = False
        self.generation += 1
        self.group_s = time.perf_counter() - t0
        self.devices = {r: v["device"] for r, v in outcome.values.items()}
        self.stacks_files = {r: v.get("stacks_file") for r, v in outcome.values.items()}
        self.controls = {r: v.get("control") for r, v in outcome.values.items()}
        self.kernels = {r: v.get("kernels") or {} for r, v in outcome.values.items()}
        self._set_threads()

    def _set_threads(self) -> None:
        # Two engines on two cores must not each spin up two intra-op threads.
        self.run(set_threads, self.world_size)

    def _rendezvous(self) -> tuple[str, int]:
        """Where the group's TCP store listens: loopback here (attached clusters ask rank 0's host)."""
        return "127.0.0.1", self._pick_port()

    def _pick_port(self) -> int:
        wish = self._port_wish
        if wish is not None and not port_is_free(wish):
            port = free_port()
            warnings.warn(f"port {wish} is in use; the process group uses free port {port} instead", stacklevel=3)
            self._port_wish = None
            return port
        return wish or free_port()

    def stop(self) -> None:
        """Stop every engine; none outlives this call, stuck or not."""
        if self._client is not None:
            try:
                self._client.close()
            except ipp_faults():
                pass  # a connection already broken: nothing left to close
        # Engines hold nothing worth a graceful exit: killing them first takes ~0.02 s, where
        # ipyparallel's SIGTERM-and-wait took 1.4 s of every cold run; their nannies follow.
        _kill(_with_children(self.pids.values()))  # each engine's nanny too: none outlives this call
        if self._lease is not None:
            # Everything else it started, whichever died first: the controller, its schedulers (alive
            # after a killed hub), a daemon a step double-forked. They all carry the lease's marker.
            self._lease.end()
            self._lease = None
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except ipp_faults():
                pass  # its processes were killed above: what it says of them is stale
        self._ipp = self._client = None
        self._busy.clear()
        self._dead.clear()

    def restart(self) -> Engines:
        """Fresh engines and a fresh group: the way out of a dead or stuck rank."""
        self.stop()
        self.pids = {}
        return self.start()

    @property
    def needs_recovery(self) -> bool:
        return self._client is None or bool(self._dead or self._busy or self.dead_ranks())

    def recover(self, wait: float | None = None) -> dict[str, Any]:
        """Bring the ranks back after a hang or a death, without restarting the notebook kernel.

        Ranks stuck in a collective are released through each rank's control thread (NCCL: the
        communicators aborted; gloo: the group's sockets cut; a rank spinning in Python interrupted),
        not left to the group's own timeout; then the same engines destroy and re-form the group on a
        fresh port. A dead rank,
        or one still stuck ``wait`` seconds later (default: the collective timeout + 5 s),
        gets fresh engines instead. Every session's rank state is dropped either way.
        """
        t0 = time.perf_counter()
        dead = sorted(set(self.dead_ranks()) | self._dead) if self.alive else []
        stuck = sorted(self._busy)
        action = "restarted the engines"
        aborted: dict[int, Any] = {}
        if self.alive and not dead and stuck:
            # Release the blocked calls through each rank's control thread (NCCL: abort the communicators;
            # gloo: cut the group's sockets) instead of waiting out the collective timeout.
            # Every rank is marked first, so a call another rank's abort releases is still put down to us.
            with ThreadPoolExecutor(max_workers=min(32, self.world_size)) as pool:  # a silent host costs 3 s once
                list(pool.map(lambda r: self.control(r, "mark"), range(self.world_size)))
                aborted = dict(zip(range(self.world_size),
                                   pool.map(lambda r: self.control(r, "abort"), range(self.world_size))))
            if not self.wait_idle(ABORT_WAIT_S):  # a rank running Python waits on no socket: stop its step
                for r in sorted(self._busy):
                    aborted[r] = {**aborted.get(r, {}), **self.control(r, "interrupt")}
            if not self.wait_idle(ABORT_WAIT_S if any(a.get("interrupted") for a in aborted.values()) else 0):
                logging.getLogger("workbench").warning(
                    "workbench: ranks %s still blocked %.0fs after the abort", sorted(self._busy), ABORT_WAIT_S)
        if self.alive and not dead and (not stuck or self.wait_idle(self.timeout + 5 if wait is None else wait)):
            self.dirty = True
            try:
                self.form_group()
                action = "re-formed the process group on the same engines"
            except ClusterError:
                pass
        if action == "restarted the engines":
            self.restart()
        info = {"action": action, "dead": dead, "stuck": stuck, "seconds": time.perf_counter() - t0,
                "aborted": {r: a.get("did") or a.get("why") or a.get("error") for r, a in aborted.items()},
                "at": time.time()}
        self.recoveries.append(info)
        logging.getLogger("workbench").warning(
            "workbench: %s (dead ranks %s, stuck ranks %s) in %.1fs", action, dead or "none", stuck or "none",
            info["seconds"])
        return info

    def __enter__(self) -> Engines:
        return self if self._client is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._client is not None

    def __repr__(self) -> str:
        dead = self.alive and (self._dead or self.dead_ranks())
        state = "stopped" if not self.alive else ("needs restart" if dead else "busy" if self._busy else "ready")
        return (f"<{type(self).__name__} ranks={self.world_size} backend={self.backend} "
                f"timeout={self.timeout:g}s {state}>")

    # -- running ----------------------------------------------------------------------
    def _view(self, rank: int):
        return self._client[self._ids[rank]]

    def submit(self, fn: Callable, *args: Any, ranks: list[int] | None = None, **kwargs: Any) -> dict[int, Any]:
        """Start ``fn`` on the ranks without waiting; returns rank -> AsyncResult."""
        self._check_usable()
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        for r in ranks:
            if not 0 <= r < self.world_size:
                raise ClusterError(f"rank {r} does not exist; ranks are 0..{self.world_size - 1}")
        for obj in (fn, *args):
            ship_by_value(obj)
        return {r: self._view(r).apply_async(fn, *args, **kwargs) for r in ranks}

    def call(self, fn: Callable, *args: Any, ranks: list[int] | None = None,
             timeout: float | None = None, watch: Callable[[set[int]], str | None] | None = None,
             busy: Callable[[list[int]], bool] | None = None, **kwargs: Any) -> Outcome:
        """Run ``fn`` on the ranks; every rank's value or failure, never an exception.

        ``watch(done_ranks)`` is polled while ranks are still running; a reason it returns ends
        the wait at once, the open ranks becoming 'timeout' failures with that reason (a
        deadlock the ledgers prove needs no deadline). ``busy(open_ranks)``, asked when the
        deadline passes: True when none of those ranks is inside a collective, so they are slow
        (a loaded machine, a big model), not hung; the wait goes on, up to ``SLOW_GRACE`` deadlines
        in all. A rank inside a collective is never waited for past the deadline.
        """
        pending = self.submit(fn, *args, ranks=ranks, **kwargs)
        return self._collect(pending, self.deadline if timeout is None else timeout, watch, busy)

    def run(self, fn: Callable, *args: Any, ranks: list[int] | None = None,
            timeout: float | None = None, **kwargs: Any) -> dict[int, Any]:
        """Run ``fn`` on the ranks and return rank -> value; raise naming every failing rank."""
        outcome = self.call(fn, *args, ranks=ranks, timeout=timeout, **kwargs)
        outcome.raise_for_failures()
        return outcome.values

    @property
    def deadline(self) -> float:
        """A call's default deadline: past the collective timeout, so gloo's own error wins."""
        return self.timeout * 1.5 + 10

    # -- health -----------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._client is None:
            raise ClusterError("the cluster is stopped; call start() or restart()")
        self._dead.update(self.dead_ranks())  # also a death between calls, while the user read a table
        if self._dead:
            raise ClusterError(f"rank(s) {sorted(self._dead)} died; call cluster.restart() for fresh engines")
        self._prune_busy()
        if self._busy:
            raise ClusterError(
                f"rank(s) {sorted(self._busy)} are still inside an earlier call past its deadline; "
                "wait for the collective timeout to release them (cluster.wait_idle()) or call cluster.restart()")

    def _prune_busy(self) -> dict[int, Any]:
        """Forget ranks whose late call has finished; the ones still busy."""
        for r, ar in list(self._busy.items()):
            if ar.ready():
                del self._busy[r]
        return self._busy

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait for ranks stuck past a deadline to come back; True when all did."""
        end = time.monotonic() + (self.timeout + 10 if timeout is None else timeout)
        while self._prune_busy() and time.monotonic() < end:
            time.sleep(0.05)
        return not self._busy

    def control(self, rank: int, cmd: str, timeout: float = 3.0) -> dict[str, Any]:
        """Ask a rank's control thread (``ping``, ``stacks``, ``mark``, ``abort``); it answers while the rank is
        stuck."""
        from workbench.rank.control import ask

        where = self.controls.get(rank)
        if not where:
            return {"error": f"rank {rank} has no control thread (its process group was never formed)"}
        return ask(where, cmd, timeout)

    def stacks(self, ranks: list[int] | None = None, wait: float = 0.3) -> dict[int, str]:
        """Each rank's Python stacks, also while it is blocked in a collective (faulthandler on SIGUSR1).

        Engines on this host get a signal (faulthandler writes from C, even while the rank holds
        the GIL); the others, or one whose dump stays empty, are asked through their control
        thread (Python's view of every thread). The main thread comes first.
        """
        out: dict[int, str] = {}
        files = getattr(self, "stacks_files", {})
        wanted = list(range(self.world_size) if ranks is None else ranks)
        ranks = [r for r in wanted if files.get(r) and self.is_local(r)]
        for r in ranks:
            try:
                open(files[r], "w").close()  # only this dump
                os.kill(self.pids[r], signal.SIGUSR1)
            except (OSError, KeyError):
                continue
        time.sleep(wait)
        for r in ranks:
            try:
                text = open(files[r]).read()
            except OSError:
                continue
            if text:
                out[r] = _main_thread_first(text)
        for r in wanted:
            if r not in out:
                threads = self.control(r, "stacks").get("stacks") or {}
                if threads:
                    out[r] = "\n\n".join(f"Thread {name}:\n{text}" for name, text in threads.items()).strip()
        return out

    def is_local(self, rank: int) -> bool:
        """Whether the rank's engine runs on this host (its pid means something here)."""
        return True

    def death_line(self, rank: int) -> str:
        """Why a rank counts as dead and the way back (an attached cluster on several hosts says more)."""
        return f"engine process {self.pids[rank]} exited; call cluster.restart()"

    def dead_ranks(self) -> list[int]:
        dead = []
        for r, pid in self.pids.items():
            try:
                if psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    dead.append(r)
            except psutil.NoSuchProcess:
                dead.append(r)
        return dead

    def _collect(self, pending: dict[int, Any], timeout: float,
                 watch: Callable[[set[int]], str | None] | None = None,
                 busy: Callable[[list[int]], bool] | None = None) -> Outcome:
        out = Outcome()
        end = time.monotonic() + timeout
        last_end = time.monotonic() + timeout * SLOW_GRACE
        death_seen: float | None = None
        last_check = last_watch = 0.0
        while True:
            open_ = [r for r, ar in pending.items() if not ar.ready()]
            if not open_:
                break
            now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                for r in self.dead_ranks():
                    if r in pending and r not in out.failures:
                        self._dead.add(r)
                        death_seen = death_seen or now
                        out.failures[r] = RankFailure(r, "died", "EngineDied", self.death_line(r))
            open_ = [r for r in open_ if r not in out.failures]
            if not open_:
                break
            reason = None
            if watch is not None and now - last_watch > WATCH_EVERY_S:
                last_watch = now
                reason = watch({r for r in pending if r not in open_})
            if reason:
                for r in open_:
                    self._busy[r] = pending[r]
                    out.failures[r] = RankFailure(r, "timeout", "Deadlock", f"deadlocked: {reason}")
                break
            if now > end and death_seen is None and now < last_end and _still_busy(busy, open_):
                end = min(now + max(timeout / 4, 1.0), last_end)  # asked again then: one collective ends it
                continue
            if now > end or (death_seen is not None and now - death_seen > DEATH_GRACE_S):
                for r in open_:
                    self._busy[r] = pending[r]
                    why = "after a peer died" if death_seen else f"past the {timeout:g}s deadline"
                    out.failures[r] = RankFailure(r, "timeout", "Timeout", f"still running {why}")
                break
            try:
                pending[open_[0]].wait(0.05)
            except KeyboardInterrupt:
                for r in open_:  # interrupted, not finished: later calls must know these ranks are busy
                    self._busy[r] = pending[r]
                raise
        for r, ar in pending.items():
            if r in out.failures:
                continue
            try:
                out.values[r] = ar.get(0)
            except ipp_faults() as exc:  # the step's own exception comes as ipyparallel's RemoteError
                out.failures[r] = _failure_from(r, exc)
                if out.failures[r].kind == "died" and self.is_local(r):  # a SIGSTOPped engine is stopped, not dead
                    out.failures[r] = stopped_failure(r, self.pids.get(r)) or out.failures[r]
                if out.failures[r].kind in LOST:
                    self._dead.add(r)
                    if out.failures[r].error == "EngineDied" and not self.is_local(r):
                        # the hub failed the task before our own check: say why as that check would (a host off
                        # the network is not a dead engine)
                        out.failures[r] = RankFailure(r, "died", "EngineDied", self.death_line(r))
        return out


def ipp_faults() -> tuple[type[BaseException], ...]:
    """What a call through ipyparallel raises for a fault of the engines, the controller or the wire, as opposed
    to a bug here: its own errors (``ipp.error``: a step's remote exception, a dead engine, no engines
    registered), a timeout or a refused/closed socket (``TimeoutError`` is an ``OSError``; ``zmq.ZMQError``),
    and what its client raises on a closed or unusable connection or a connection file it cannot read
    (RuntimeError, ValueError, KeyError)."""
    import ipyparallel.error
    import zmq

    return (OSError, RuntimeError, ValueError, KeyError, zmq.ZMQError, ipyparallel.error.IPythonError)


def _still_busy(busy: Callable[[list[int]], bool] | None, open_: list[int]) -> bool:
    """Whether the open ranks are all busy outside any collective (a failing check counts as no)."""
    if busy is None:
        return False
    try:
        return bool(busy(open_))
    except (OSError, ValueError, KeyError, TypeError):  # a ledger file being written or gone: not known busy
        return False


def _main_thread_first(dump: str) -> str:
    """faulthandler's dump with the main thread (the one marked 'most recent call first' and
    'Current thread' on the signal) moved to the front, engine-internal threads after."""
    blocks = [b for b in dump.split("\n\n") if b.strip()]
    main = [b for b in blocks if "Current thread" in b or "<module>" in b.splitlines()[-1]]
    rest = [b for b in blocks if b not in main]
    return "\n\n".join(main + rest).strip()


def ship_by_value(obj: Any) -> None:
    """Send functions from local files (tests, notebooks' helper modules) by value.

    Engines import what is installed (torch, workbench); a module the client loaded
    from a loose file is not importable there, so cloudpickle must carry its code.
    """

    import cloudpickle

    mod_name = getattr(obj, "__module__", None)
    module = sys.modules.get(mod_name or "")
    path = getattr(module, "__file__", None)
    if module is None or path is None or mod_name == "__main__" or mod_name.split(".")[0] == "workbench":
        return
    if not path.startswith((sys.prefix, sys.base_prefix)):
        cloudpickle.register_pickle_by_value(module)


class _StoppedEarly(ClusterError):
    """The engine set (or the controller) stopped while the cluster started: worth one more try on fresh ports."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


_IN_USE = re.compile(r"Address already in use \(addr='(?:tcp://)?([^']+)'\)")
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


def _stopped_early(exc: BaseException) -> bool:
    """The start failed because the engines it started ended (ipyparallel's client: "Engine set stopped"), not
    because they were slow."""
    return "Engine set stopped" in str(exc)


def _stop_cause(ipp_cluster: Any) -> str:
    """What the start-up's logs say stopped it, in one line: the port in use where a bind failed (the usual
    cause: a port picked, then taken by another process before it was bound), else the last error line."""
    logs: list[tuple[str, str]] = []
    try:
        logs += [("an engine", es.get_output() or "") for es in (ipp_cluster.engines or {}).values()]
        if ipp_cluster.controller is not None:
            logs.append(("the controller", ipp_cluster.controller.get_output() or ""))
    except (OSError, AttributeError, ValueError):  # a launcher that never started has no output (or log file) to read
        pass
    for who, text in logs:
        found = _IN_USE.search(text)
        if found:
            return f"{who} could not bind {found.group(1)}: port in use"
    for who, text in logs:
        errors = [m.group(0) for line in text.splitlines() if (m := _ERROR_LINE.match(line.strip()))]
        if errors:
            return f"the engine set stopped during start-up ({who}: {errors[-1][:300]})"
    return "the engine set stopped during start-up (its logs name no cause)"


def stopped_failure(rank: int, pid: int | None) -> RankFailure | None:
    """A rank the hub dropped because its process is stopped (SIGSTOP, Ctrl-Z), not dead; None otherwise."""
    try:
        if pid is None or psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            return None
    except psutil.NoSuchProcess:
        return None
    return RankFailure(rank, "stopped", "EngineStopped",
                       f"engine process {pid} is stopped (SIGSTOP or Ctrl-Z), not dead; the controller dropped it "
                       f"after its missed heartbeats (`kill -CONT {pid}` resumes the process); call cluster.restart()")


def _failure_from(rank: int, exc: BaseException) -> RankFailure:
    ename = getattr(exc, "ename", None)
    if "EngineError" in (ename, type(exc).__name__):
        return RankFailure(rank, "died", "EngineDied", f"{getattr(exc, 'evalue', exc)}; call cluster.restart()")
    if ename:
        tb = "\n".join(getattr(exc, "traceback", "") or []) if isinstance(getattr(exc, "traceback", ""), list) \
            else str(getattr(exc, "traceback", "") or "")
        return RankFailure(rank, "error", ename, str(getattr(exc, "evalue", "")), tb)
    return RankFailure(rank, "error", type(exc).__name__, str(exc))


def _with_children(pids: Any) -> list[int]:
    out = list(pids)
    for pid in list(out):
        try:
            out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return out


def _kill(pids: Any) -> None:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        procs.append(p)
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    live_lease.wait_gone(procs, timeout=5)
    live_lease.clear_leftovers([p.pid for p in procs])  # what they left in the temp dir and /dev/shm


