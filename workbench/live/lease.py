"""The ranks die with the client that started them: a marker, a reaper and a lease.

A notebook kernel killed by the OOM killer, or ``workbench run`` killed with SIGKILL, runs
no cleanup at all, and ipyparallel starts its controller and engines in sessions of their
own (``start_new_session=True``), so nothing ends them: 13 processes, ~1.2 GB, measured
running a minute later and beyond. Three parts close that:

- **A marker.** Every process the workbench starts carries ``WORKBENCH_TREE=<token>`` in its
  environment, and so does everything those processes start: the controller's schedulers,
  the engines' nannies, a daemon a step double-forks (reparented to init, no longer anyone's
  child). ``members(token)`` finds them all by reading ``/proc/<pid>/environ``, whichever of
  them died first, so ``stop()`` ends the whole tree even after the hub itself was killed.
- **A reaper.** One small process per cluster, started from this file as a script (stdlib and
  psutil only: it never imports the workbench, pandas or torch). It asks for a parent-death
  signal (Linux ``prctl``), so the client's death wakes it at once, and polls the client's pid
  as a fallback; then it kills every marked process and exits.
- **A lease.** The client touches a file every few seconds from a daemon thread; a client that
  stops renewing it (SIGSTOP, a frozen kernel) for ``WORKBENCH_LEASE_S`` seconds (default 120)
  counts as dead too.

Ranks attached from ``workbench up`` or ``wb.connect`` are not started here and carry no
marker of this client: they outlive it, as they should.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import psutil

MARK = "WORKBENCH_TREE"
LEASE_S = 120.0  # a client silent this long counts as dead (WORKBENCH_LEASE_S overrides)
POLL_S = 0.2  # how often the reaper looks at the client (the parent-death signal is faster)


def lease_seconds() -> float:
    try:
        return max(1.0, float(os.environ.get("WORKBENCH_LEASE_S", LEASE_S)))
    except ValueError:
        return LEASE_S


class Lease:
    """One started cluster's marker, reaper and lease file; ``end()`` kills everything marked."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.dir = tempfile.mkdtemp(prefix="wb-lease-")
        self.file = os.path.join(self.dir, "lease")
        self.seconds = lease_seconds()
        self.reaper: subprocess.Popen | None = None
        self._stop = threading.Event()

    @property
    def env(self) -> dict[str, str]:
        """What the started processes' environment gets: the marker."""
        return {MARK: self.token}

    def start(self) -> Lease:
        """Start the reaper and the renewing thread: from now on a dead client takes the marked tree along."""
        open(self.file, "w").close()
        env = {k: v for k, v in os.environ.items() if k != MARK}
        self.reaper = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(os.getpid()), self.token, self.file, str(self.seconds)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env, start_new_session=True, close_fds=True)
        threading.Thread(target=self._renew, name="workbench-lease", daemon=True).start()
        return self

    def _renew(self) -> None:
        every = min(5.0, self.seconds / 4)
        while not self._stop.wait(every):
            try:
                os.utime(self.file)
            except OSError:
                return

    def end(self) -> int:
        """Kill every process carrying this lease's marker, then the reaper; how many were killed."""
        self._stop.set()
        n = kill(members(self.token))
        shutil.rmtree(self.dir, ignore_errors=True)  # the reaper sees its lease gone and exits quietly
        if self.reaper is not None:
            try:
                self.reaper.kill()
                self.reaper.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        return n


def members(token: str) -> list[psutil.Process]:
    """Every process (this user can read) whose environment carries ``token``; never the caller."""
    me = os.getpid()
    out = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(MARK) == token:
                out.append(p)
        except (psutil.Error, OSError):
            continue  # another user's process, or gone
    return out


def kill(procs: list[psutil.Process]) -> int:
    """SIGKILL each process and wait for it; the count killed (a zombie counts as gone)."""
    n = 0
    for p in procs:
        try:
            p.kill()
            n += 1
        except psutil.Error:
            pass
    wait_gone(procs, timeout=5)
    clear_leftovers([p.pid for p in procs])
    return n


def clear_leftovers(pids: list[int]) -> int:
    """What killed processes could not remove themselves, on this host: their stacks files and work dirs,
    their torch shared-memory managers' dirs and segments (``rank/stacks.sweep_stale``, ``rank/leftovers``).
    Stdlib only, so the reaper can run it too; a failure here never stops an ending."""
    if not pids:
        return 0
    try:
        from workbench.rank import stacks

        return stacks.sweep_stale(pids=pids)
    except (OSError, ImportError, ValueError):  # a file gone or unreadable mid-sweep: what is left stays
        return 0


def running(p: psutil.Process) -> bool:
    """Whether ``p`` still runs: a zombie has exited (it waits only for its parent to read its status)."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each process has exited: gone, or a zombie. An engine whose nanny was killed with it is
    reparented to PID 1, which in a container may reap late; psutil's own wait polls until the zombie
    is reaped (measured: 1-2 s of every ``cluster.stop()``), though a zombie holds nothing. Returns the
    processes still running at the timeout."""
    end = time.monotonic() + timeout
    left = list(procs)
    while left and time.monotonic() < end:
        left = [p for p in left if running(p)]
        if left:
            time.sleep(0.005)
    for p in list(procs):  # our own children: reap them, or they stay zombies for this process's life
        try:
            os.waitpid(p.pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass
    return left


def end_tree(token: str, rounds: int = 3, within: float = 8.0) -> int:
    """Kill the marked tree, round after round until a look finds none (at least ``rounds`` looks, and more
    for ``within`` seconds): a process forking while a round ran is caught by the next."""
    total, end = 0, time.monotonic() + within
    for n in itertools.count():
        procs = members(token)
        if not procs or (n >= rounds and time.monotonic() > end):
            break
        total += kill(procs)
    return total


# -- the reaper (run as a script) --------------------------------------------------------------
def _client_gone(pid: int, born: float | None) -> bool:
    try:
        p = psutil.Process(pid)
        return (born is not None and p.create_time() != born) or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _parent_death_signal(sig: int) -> None:
    """Ask Linux to send ``sig`` when the client (our parent) dies; elsewhere the poll alone watches."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def reap(client: int, token: str, lease_file: str, lease_s: float) -> str:
    """Wait until the client dies or lets its lease lapse, then end the tree; why it ended. A watch that
    fails (an error reading the client's state) ends the tree too: a reaper that dies quietly leaves it."""
    try:
        why = _watch(client, lease_file, lease_s)
    except BaseException as exc:  # whatever stopped the watch, the tree must not outlive it
        why = f"the watch failed: {type(exc).__name__}: {exc}"
    if why != "stopped":
        end_tree(token)
        shutil.rmtree(os.path.dirname(lease_file), ignore_errors=True)
        if why == "client died":
            clear_leftovers([client])  # the dead client's own temp dirs (its manifest's), a zombie or not
    return why


def _watch(client: int, lease_file: str, lease_s: float) -> str:
    # The parent-death signal is taken synchronously (blocked, then waited for), never by a handler: a handler
    # that set a threading.Event could land while this thread held that Event's lock (in its clear() or wait()),
    # and then waited on it for ever; the client gone, the reaper slept on and the tree outlived it (seen: 2 in
    # 15 SIGKILLed notebook kernels).
    synchronous = sys.platform.startswith("linux") and hasattr(signal, "sigtimedwait")
    if synchronous:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        _parent_death_signal(signal.SIGUSR1)
    try:
        born: float | None = psutil.Process(client).create_time()
    except psutil.NoSuchProcess:
        born = None
    look_now = os.getppid() != client  # the client died before the signal was armed
    while True:
        if not look_now:
            if synchronous:
                signal.sigtimedwait([signal.SIGUSR1], POLL_S)
            else:
                time.sleep(POLL_S)
        look_now = False
        if not os.path.exists(lease_file):
            return "stopped"  # the client ended the tree itself
        if _client_gone(client, born):
            return "client died"
        try:
            if time.time() - os.path.getmtime(lease_file) > lease_s:
                return f"client silent for {lease_s:g}s"
        except OSError:
            return "stopped"


if __name__ == "__main__":
    reap(int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]))
