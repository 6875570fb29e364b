"""Engines forked from one process that imported torch once: a cluster pays the import once, not per engine.

Every engine imports torch, ipyparallel's engine and the workbench's rank layer before it can do anything:
~3 s of CPU apiece on these machines, so a 4-rank cluster spent ~12 s of CPU (and, on two cores, most of its
start-up wall time) importing the same modules four times. Here ipyparallel launches one process (an engine
*set*, as its MPI launcher does with ``mpiexec``) that imports them and then forks the engines; each child runs
ipyparallel's own engine ``main`` with the arguments ipyparallel gave, so an engine is the engine ipyparallel
would have started, minus the imports.

What stays true for the rest of the workbench:
- the lease's marker: the process is started with the client's environment, and a forked child's
  ``/proc/<pid>/environ`` is its parent's, so ``down`` and the reaper find the engines by it as before;
- an engine's pid is its own (``os.getpid()`` in the engine), killed and watched as before; the set process
  forwards SIGTERM/SIGINT/SIGHUP to the engines and exits with them, and an engine dies with the set process
  (``PR_SET_PDEATHSIG``) if that is killed outright;
- nothing touches a GPU before the fork: importing the rank layer initialises CUDA lazily. If something did
  (``torch.cuda.is_initialized()``), the children exec a plain ``python -m ipyparallel.engine`` instead of
  running in the forked image (a CUDA context does not survive a fork).

``WORKBENCH_ENGINE_FORK=0`` starts engines the plain way (one ``python -m ipyparallel.engine`` each).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

from ipyparallel.cluster.launcher import EngineLauncher, LocalProcessLauncher
from traitlets import List, Unicode

ENV = "WORKBENCH_ENGINE_FORK"


def enabled() -> bool:
    """Fork engines unless the user said not to (or the platform cannot)."""
    return os.environ.get(ENV, "1") != "0" and hasattr(os, "fork") and sys.platform == "linux"


# What each engine the workbench starts does less of per call: its stdout/stderr skip ipykernel's empty flushes
# (``workbench.rank.outstream``: named here, not imported, so the client does not import ipykernel for it), and
# its log keeps warnings and errors (what ``_stop_cause`` reads), not a line written and flushed for every request.
# And no nanny: ipyparallel starts one more Python process per engine (~0.6 CPU-s on the 2-core box, a quarter of a
# forked 4-rank cluster's start) to relay signals to that one engine and report its exit before the heartbeat
# does; the workbench signals engines through their launcher or their pid and tells a dead rank by its pid.
ENGINE_ARGS = ["--IPEngine.out_stream_factory=workbench.rank.outstream.QuietFlushStream", "--IPEngine.log_level=WARN",
               "--IPEngine.enable_nanny=False"]


def cluster_kwargs(preimport: tuple[str, ...] = ()) -> dict:
    """``ipp.Cluster``'s arguments for the workbench's engines: their arguments, and for forked engines (unless
    they are off) the launcher and what its set imports beyond torch and the rank layer."""
    from traitlets.config import Config

    config = Config(EngineLauncher={"engine_args": list(ENGINE_ARGS)})
    if not enabled():
        return {"config": config}
    config.ForkEngineSetLauncher = Config(preimport=list(preimport))
    return {"engine_launcher_class": ForkEngineSetLauncher, "config": config}


class ForkEngineSetLauncher(LocalProcessLauncher, EngineLauncher):
    """ipyparallel's engine-set launcher contract, met by one process that forks ``n`` engines."""

    # How the cluster file names this class (``workbench down`` loads it back by it): its dotted path, which
    # traitlets imports, and no scan of the installed packages' entry points to find a name it has none of.
    entrypoint_name = f"{__name__}.ForkEngineSetLauncher"

    preimport = List(Unicode(), config=True,
                     help="modules the set imports for every engine before it forks them, beyond torch and the rank "
                          "layer (``workbench up`` names the ones it warms: transformers' model classes)")

    def find_args(self) -> list[str]:
        engine = self.engine_cmd + self.cluster_args + self.engine_args
        return [sys.executable, "-m", __name__, str(self.n), ",".join(self.preimport), "--", *engine]

    def start(self, n: int):  # ipyparallel's signature
        self.n = n
        return super().start()


# -- the set process (python -m workbench.live.engine_fork N MODULES -- ENGINE_CMD...) -------------------------
def _preimport(extra: list[str]) -> None:
    """What every engine would import on its own, imported once before the fork."""
    import ipyparallel.engine.app  # noqa: F401

    from workbench.rank.warmup import import_rank_layer
    import_rank_layer()  # torch and the rank layer, with the engines' progress-bar rule
    if extra:  # best effort, as on a rank: an engine that needs a module imports it (and says why not) itself
        from workbench.rank.remote import warm

        warm(tuple(extra))


def _child(engine_cmd: list[str], forked_image: bool) -> None:
    """Become one engine; never returns."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        _die_with_parent()
        fresh_process_state()
        if not forked_image or engine_cmd[1:3] != ["-m", "ipyparallel.engine"]:
            os.execv(engine_cmd[0], engine_cmd)  # an engine command of the user's own, or no shared image
        from ipyparallel.engine.app import main

        sys.argv = [engine_cmd[0], *engine_cmd[3:]]
        main(argv=engine_cmd[3:])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # a process boundary: the engine's own failure printed as it would print it, then exit 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fresh_process_state() -> None:
    """What a process of its own would have drawn fresh, drawn fresh in a forked engine.

    Python's ``random`` reseeds itself after a fork; numpy's global generator does not (the DataLoader
    workers' old trap). Where the set imported it (``up``'s warm list does), every engine would draw the same
    unseeded stream, and a user's code seeding nothing would read as ranks that agree, which they would not in
    their own job."""
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no libc.so.6 or no prctl; the lease's reaper finds orphans by their marker
        pass
    if os.getppid() == 1:  # the set process died before the prctl took effect
        os._exit(1)


def _supervise(children: list[int]) -> int:
    """Forward the stop signals ipyparallel sends to the set, and exit once every engine has."""
    def forward(sig: int, _frame: object) -> None:
        for pid in children:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    status, left = 0, set(children)
    while left:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid in left:
            left.discard(pid)
            code = os.waitstatus_to_exitcode(raw)
            status = status or (code if code > 0 else 128 - code if code < 0 else 0)
    return status


def main(argv: list[str]) -> int:
    n, extra, engine_cmd = int(argv[0]), [m for m in argv[1].split(",") if m], argv[3:]
    try:
        _preimport(extra)
        forked_image = True
    except Exception as exc:  # a module's import runs its code, which raises anything: said; each engine then imports
        # (and reports) for itself
        print(f"workbench: the engines' shared import failed ({type(exc).__name__}: {exc}); "
              "each engine starts on its own", file=sys.stderr)
        forked_image = False
    if forked_image and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        forked_image = False  # a CUDA context does not survive a fork
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for _ in range(n):
        with warnings.catch_warnings():
            # Python 3.12+ warns on a fork from a process with more than one thread: importing torch starts
            # one, as it does in every process a DataLoader forks its workers from; the engines never join it.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _child(engine_cmd, forked_image)
        children.append(pid)
    return _supervise(children)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
