"""Running clusters on disk: start one in the background, find it, list them, stop it.

ipyparallel records every cluster it starts in ``<profile>/security/cluster-<id>.json``
(``ipcluster list`` and ``ClusterManager`` read the same files); ``workbench up`` starts one
through ``ipp.Cluster`` and leaves it running, ``workbench down`` stops it with no process
left, ``workbench status`` lists them. A small ``workbench-<id>.json`` beside the cluster
file keeps what ipyparallel does not: the backend the ranks resolved to. No launcher here.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import time
import uuid
from typing import Any

import psutil

from workbench.errors import ClusterError
from workbench.live import lease as live_lease

WAIT_S = 5.0  # how long an attach waits for engines still registering before it says so
UP_TIMEOUT_S = 120.0  # engines registering after `workbench up` (a loaded 2-core box needs ~10 s)
WARM_WAIT_S = 60.0  # how long `up` waits for the ranks' imports (FSDP, transformers: ~5 s on 2 cores)


def ipyparallel() -> Any:
    """``import ipyparallel``, with one scan of the installed packages' entry points instead of four.

    Its two ``Launcher`` traits list the installed launchers in their help text, which traitlets reads twice per
    trait while ipyparallel's ``Cluster`` class is defined: four scans of every installed distribution (~18 ms each
    on the 2-core box, 236 packages) on every client start. While the package is first imported, one snapshot of
    the entry points answers them; ipyparallel's own function is put back afterwards, so later lookups (a
    launcher named by the user) read the installed packages as before."""
    import sys

    if "ipyparallel" in sys.modules:
        return sys.modules["ipyparallel"]
    from importlib import metadata

    scan = metadata.entry_points
    snapshot = scan()
    metadata.entry_points = lambda **select: snapshot.select(**select) if select else snapshot
    try:
        import ipyparallel as ipp
    finally:
        metadata.entry_points = scan
        traits = sys.modules.get("ipyparallel.traitlets")
        if traits is not None and getattr(traits, "entry_points", scan) is not scan:
            traits.entry_points = scan
    return ipp


def cluster_file_faults() -> tuple[type[BaseException], ...]:
    """What rebuilding ipyparallel's ``Cluster`` from its JSON file raises for a file another process wrote
    (damaged, or from another version): the read and the parse, a missing or mistyped field, a launcher class
    that no longer imports, a trait value it refuses."""
    import traitlets

    return (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError, traitlets.TraitError)


def ipython_dir() -> str:
    """``$IPYTHONDIR``, else ``~/.ipython``; when that cannot be written, one fixed per-user directory in the
    temp dir. (IPython's own fallback is a fresh temp dir per process: ``up`` then recorded a cluster that
    ``status`` and ``down`` never found.)"""
    env = os.environ.get("IPYTHONDIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    home = os.path.expanduser("~")
    ipdir = os.path.join(home, ".ipython")
    if (os.path.isdir(ipdir) and os.access(ipdir, os.W_OK | os.X_OK)) or \
            (not os.path.exists(ipdir) and os.path.isdir(home) and os.access(home, os.W_OK | os.X_OK)):
        return ipdir
    fallback = os.path.join(tempfile.gettempdir(), f"workbench-ipython-{os.getuid()}")
    os.makedirs(fallback, mode=0o700, exist_ok=True)
    st = os.lstat(fallback)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # someone else's (or a link): not ours
        raise ClusterError(f"{ipdir} is not writable and {fallback} is not this user's directory; "
                           "set IPYTHONDIR to a directory you own")
    return fallback


def split_key(profile: str | None, cluster_id: str = "") -> tuple[str | None, str]:
    """``status`` prints clusters as ``profile:cluster_id``: accept that spelling wherever a profile goes."""
    if profile and not cluster_id and ":" in profile and os.sep not in profile:
        name, cid = profile.rsplit(":", 1)
        return name or None, cid
    return profile, cluster_id


def profile_dir(profile: str | None) -> str:
    """A profile name (``<ipython dir>/profile_<name>``) or a directory path, as an absolute path."""
    profile = profile or "default"
    if os.sep in profile or profile.startswith("."):
        return os.path.abspath(os.path.expanduser(profile))
    return os.path.join(ipython_dir(), f"profile_{profile}")


def _controller_gone(ipc: Any) -> int | None:
    """The pid of a local controller that the cluster file records but that is no longer running."""
    ctl = ipc.controller
    pid = getattr(ctl, "pid", None)
    if ctl is None or "Local" not in type(ctl).__name__ or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        return pid if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return pid


def load(profile: str | None, cluster_id: str = "", strict: bool = True) -> Any:
    """The running ``ipp.Cluster`` recorded in a profile; one clear line when there is none."""
    ipp = ipyparallel()

    profile, cluster_id = split_key(profile, cluster_id)
    pdir = profile_dir(profile)
    name = profile or "default"
    if not os.path.isdir(pdir):
        raise ClusterError(f"unknown profile {name!r}: no profile directory {pdir} "
                           f"(start a cluster with `workbench up --ranks N --profile {name}`)")
    path = os.path.join(pdir, "security", f"cluster-{cluster_id}.json")
    try:
        ipc = ipp.Cluster.from_file(path, profile_dir=pdir, cluster_id=cluster_id, log_level=50)
    except FileNotFoundError:
        raise ClusterError(f"no running cluster in profile {name!r}"
                           f"{' with id ' + repr(cluster_id) if cluster_id else ''} (no {path}); "
                           f"start one with `workbench up --ranks N --profile {name}`") from None
    except cluster_file_faults() as exc:
        raise ClusterError(f"cannot read the cluster file {path}: {exc}") from None
    if ipc.controller is None and strict:
        raise ClusterError(f"the controller of cluster {name!r} is not running (stale {path}); "
                           f"`workbench down --profile {name}` clears it")
    return ipc


_LOCAL = {"controller": ("local", "ipyparallel.cluster.launcher.LocalControllerLauncher"),
          "engines": ("local", "ipyparallel.cluster.launcher.LocalEngineSetLauncher")}


def peek(profile: str | None, cluster_id: str = "") -> tuple[str, int] | None:
    """The profile directory and engine count of a running cluster of local processes (what ``up`` and
    ``ipcluster start`` record), read from the cluster file as JSON; None for anything else (another launcher,
    a process gone, a file that does not parse), which ``load`` then reads as before.

    ``load`` builds ipyparallel's ``Cluster`` and launchers from the file, which scans every installed
    package's entry points several times (0.3-1 s on the 2-core box): an attach needs only the two numbers."""
    profile, cluster_id = split_key(profile, cluster_id)
    pdir = profile_dir(profile)
    try:
        with open(os.path.join(pdir, "security", f"cluster-{cluster_id}.json")) as f:
            d = json.load(f)
        if d["cluster"].get("class", "ipyparallel.cluster.cluster.Cluster") != "ipyparallel.cluster.cluster.Cluster":
            return None
        ctl, eng = d["controller"], d["engines"]
        if ctl["class"] not in _LOCAL["controller"] or eng["class"] not in _LOCAL["engines"]:
            return None
        pids = [ctl["state"]["pid"]] + [e["pid"] for es in eng["sets"].values() for e in es["engines"].values()]
        n = [len(es["engines"]) for es in eng["sets"].values()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not n or not all(n) or not all(isinstance(p, int) and p > 0 and psutil.pid_exists(p) for p in pids):
        return None  # as ipyparallel reads it: a process gone changes the count, or means no controller
    return pdir, sum(n)


def expected_engines(ipc: Any) -> int | None:
    """How many engines the cluster's launchers started (None when they do not say)."""
    sets = list(getattr(ipc, "engines", {}).values())
    counts = [getattr(es, "n", None) for es in sets]
    return sum(counts) if sets and all(isinstance(n, int) and n > 0 for n in counts) else None


def stop_cluster(ipc: Any, engine_pids: Any = (), token: str | None = None) -> int:
    """Stop a recorded cluster through ipyparallel and make sure no local process of it is left.

    Engines hold nothing worth a graceful exit (as in ``Engines.stop``): the local ones are
    killed first, which spares ipyparallel's SIGTERM-and-wait (~15 s measured on 2 cores).
    ``token``: the marker ``up`` gave every process of the cluster (``lease.MARK``); whatever the
    live parent tree no longer leads to (a dead hub's schedulers, reparented to PID 1) is found by it."""
    engines = [p for es in ipc.engines.values() for p in
               [getattr(la, "pid", -1) for la in getattr(es, "launchers", {}).values()] + [getattr(es, "pid", -1)]]
    engines = [p for p in [*engines, *engine_pids] if isinstance(p, int) and p > 0]
    for pid in list(engines):  # the engines' nannies and kernels under their launch processes
        try:
            engines += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    reap(engines, timeout=0)
    controller = [ipc.controller.pid] if ipc.controller is not None and getattr(ipc.controller, "pid", 0) > 0 else []
    for pid in list(controller):  # its schedulers
        try:
            controller += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    try:
        ipc.stop_cluster_sync()
    except Exception:  # cleanup must go on: the reap below is what leaves no process, whatever ipyparallel raised
        pass
    reap(controller)
    ipc.remove_cluster_file()
    seen = set(engines) | set(controller)
    orphans = [p for p in live_lease.members(token) if p.pid not in seen] if token else []
    n = len(seen) + live_lease.kill(orphans) + (live_lease.end_tree(token, rounds=1, within=0) if token else 0)
    live_lease.clear_leftovers(sorted(seen))  # what its engines left in the temp dir and /dev/shm
    return n


def reap(pids: Any, timeout: float = 10.0) -> None:
    """Wait for the given local processes to exit; kill the ones that do not."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    alive = live_lease.wait_gone(procs, timeout=timeout)  # a zombie has exited: no wait for PID 1 to reap it
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    live_lease.wait_gone(alive, timeout=5)


def processes(profile: str | None, cluster_id: str = "") -> list[int]:
    """Every local process of a recorded cluster (controller, engine launches, their children) still alive."""
    try:
        ipc = load(profile, cluster_id, strict=False)
    except ClusterError:
        return []
    roots = [ipc.controller.pid] if ipc.controller is not None else []
    roots += [la.pid for es in ipc.engines.values() for la in getattr(es, "launchers", {}).values()]
    token = tree_token(ipc.profile_dir, ipc.cluster_id)
    out = [p.pid for p in live_lease.members(token)] if token else []  # what no live parent leads to too
    for pid in roots:
        try:
            p = psutil.Process(pid)
            out += [pid, *(c.pid for c in p.children(recursive=True))]
        except psutil.NoSuchProcess:
            continue
    return list(dict.fromkeys(out))


def sidecar(pdir: str, cluster_id: str = "") -> str:
    return os.path.join(pdir, "security", f"workbench-{cluster_id}.json")


def tree_token(pdir: str, cluster_id: str = "") -> str | None:
    """The marker every process of a cluster ``up`` started carries (None: not started by ``up``, or an older one)."""
    try:
        with open(sidecar(pdir, cluster_id)) as f:
            token = json.load(f).get("tree")
    except (OSError, ValueError, AttributeError):
        return None
    return token if isinstance(token, str) and len(token) == 32 else None


def up(ranks: int, profile: str | None = None, cluster_id: str = "", backend: str = "auto") -> dict[str, Any]:
    """Start a controller and ``ranks`` engines in the background, warm them (torch, FSDP and transformers
    imported), and return.

    ``ipp.Cluster(shutdown_atexit=False)`` writes the cluster file and starts its processes
    in their own sessions, so they outlive this process until ``down()``."""
    ipp = ipyparallel()
    from IPython.core.profiledir import ProfileDir

    from workbench.live import engine_fork
    from workbench.live.engines import CONTROLLER_ARGS, _import_rank_layer, first_answers
    from workbench.rank.byname import RankFn
    from workbench.rank.host import order, pick_backend, whoami
    from workbench.rank.warmup import WARM_MODULES

    if ranks < 1:
        raise ClusterError(f"ranks must be >= 1, got {ranks}")
    pdir = profile_dir(profile)
    name = profile or "default"
    if os.path.isfile(os.path.join(pdir, "security", f"cluster-{cluster_id}.json")):
        old = load(profile, cluster_id, strict=False)
        if old.controller is not None:
            raise ClusterError(f"a cluster is already running in profile {name!r}; "
                               f"`workbench down --profile {name}` stops it")
        down(profile, cluster_id)
    try:
        ProfileDir.create_profile_dir(pdir)
    except OSError as exc:
        raise ClusterError(f"cannot create the profile directory {pdir}: {exc.strerror or exc}") from None
    t0 = time.time()
    # Every process of the cluster carries a marker (the controller's schedulers, the engines' nannies): `down`
    # finds them by it whichever died first. Recorded before any process starts: a killed `up` leaves it too.
    token = uuid.uuid4().hex
    with open(sidecar(pdir, cluster_id), "w") as f:
        json.dump({"tree": token, "started": t0, "profile": name, "cluster_id": cluster_id}, f)
    saved = os.environ.get(live_lease.MARK)
    os.environ[live_lease.MARK] = token
    # Forked engines: the set imports what the warm-up below would import in every engine, once.
    ipc = ipp.Cluster(profile_dir=pdir, cluster_id=cluster_id, n=ranks, controller_args=CONTROLLER_ARGS,
                      shutdown_atexit=False, log_level=logging.WARNING, **engine_fork.cluster_kwargs(WARM_MODULES))
    client = None
    try:
        client = ipc.start_and_connect_sync()
        _restore(live_lease.MARK, saved)  # started: the marker is in their environments now
        client.wait_for_engines(ranks, timeout=UP_TIMEOUT_S)
        view = client[sorted(client.ids)]
        view.use_cloudpickle()
        infos = dict(zip(view.targets, first_answers(view, whoami, "where it runs")))
        # warm: the first attached run does not pay torch's import
        first_answers(view, _import_rank_layer, "the rank layer's import")
        # ... nor FSDP's and transformers' (seconds more): awaited, so the first run right after `up` finds the
        # ranks warm (queued and not awaited, the imports would make that run wait behind them: 9 s against
        # 1.5 s). Then the first calls of a scenario's first steps on a throwaway tiny model (lab/models.py says
        # which: a first run's load and forward took 2-3x their later times without them). Past WARM_WAIT_S the
        # rest stays queued on the engines and `up` says so.
        t_warm = time.time()
        warming = [view.apply_async(RankFn("workbench.rank.remote", "warm")),
                   view.apply_async(RankFn("workbench.lab.models", "warm_first_calls"))]
        try:
            for ar in warming:
                ar.get(timeout=max(0.0, t_warm + WARM_WAIT_S - time.time()))
            warm_s: float | None = time.time() - t_warm
        except TimeoutError:  # ipyparallel's is the builtin; a module that would not import fails the start below
            for ar in warming:
                leave_queued(client, ar, view.targets)
            warm_s = None
        ranked = order(infos)
        resolved = pick_backend(backend, [infos[e] for e, _ in ranked], [li for _, li in ranked])
    except BaseException as exc:  # a boundary: whatever stopped the start (Ctrl-C too) leaves no process, one line
        _restore(live_lease.MARK, saved)
        if client is not None:
            client.close()
        stop_cluster(ipc, token=token)
        try:
            os.remove(sidecar(pdir, cluster_id))
        except FileNotFoundError:
            pass
        if isinstance(exc, (ClusterError, KeyboardInterrupt)):  # Ctrl-C/SIGTERM: main says "interrupted", rc 130
            raise
        raise ClusterError(f"could not start {ranks} engines in profile {name!r}: {exc}") from None
    client.close()
    doc = {"ranks": ranks, "backend": resolved, "started": t0, "profile": name, "cluster_id": cluster_id,
           "pdir": pdir, "seconds": time.time() - t0, "tree": token, "warm_s": warm_s}
    with open(sidecar(pdir, cluster_id), "w") as f:
        json.dump(doc, f)
    return doc


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def leave_queued(client: Any, ar: Any, targets: list[int], wait: float = 5.0) -> bool:
    """Return once the controller holds ``ar``'s task in every target's queue (or it ran): then the
    engines run it after this client has gone. Sent alone is not enough: a client that closes right
    after sending loses the message (measured). False when the controller did not confirm in ``wait`` s."""
    ar.wait_for_send(wait)
    end = time.monotonic() + wait
    while time.monotonic() < end:
        q = client.queue_status(targets=targets)
        if ar.ready() or all(q[e]["queue"] > 0 for e in targets):
            return True
        time.sleep(0.02)
    return False


def down(profile: str | None = None, cluster_id: str = "") -> int:
    """Stop the cluster of a profile (a stale record included); the number of processes it had."""
    profile, cluster_id = split_key(profile, cluster_id)
    ipc = None
    if not cluster_id:
        cluster_id, ipc = _only_orphan(profile)
    # the cluster _only_orphan loaded, not a second load: ipyparallel removes the file of a cluster with no
    # process left when it loads it (a killed run's, once its reaper has ended the tree)
    ipc = ipc or load(profile, cluster_id, strict=False)
    n = stop_cluster(ipc, token=tree_token(ipc.profile_dir, cluster_id))
    try:
        os.remove(sidecar(ipc.profile_dir, cluster_id))
    except FileNotFoundError:
        pass
    return n


def _recorded_ids(pdir: str) -> list[str]:
    try:
        names = os.listdir(os.path.join(pdir, "security"))
    except OSError:
        return []
    return sorted(n[len("cluster-"):-len(".json")] for n in names if n.startswith("cluster-") and n.endswith(".json"))


def _orphaned(ipc: Any) -> bool:
    """Whether no live process owns the cluster: its controller is gone, or was left to init by a killed run."""
    ctl = ipc.controller
    pid = getattr(ctl, "pid", None)
    if ctl is None or _controller_gone(ipc):
        return True
    try:
        return isinstance(pid, int) and psutil.Process(pid).ppid() in (0, 1)
    except psutil.NoSuchProcess:
        return True


def _only_orphan(profile: str | None) -> tuple[str, Any]:
    """With no ``--cluster-id`` and no cluster of id '' in the profile: the id of its one recorded cluster
    when no live process owns it (a run killed with SIGKILL leaves ``default:<id>``), and that cluster as
    loaded (None: not loaded here); else a line naming them."""
    pdir = profile_dir(profile)
    ids = _recorded_ids(pdir)
    if not ids or "" in ids:
        return "", None
    name = profile or "default"
    owned, loaded = [], {}
    for cid in ids:
        try:
            loaded[cid] = ipc = load(profile, cid, strict=False)
        except ClusterError:
            continue
        if not _orphaned(ipc):
            owned.append(cid)
    if len(ids) == 1 and not owned:
        return ids[0], loaded.get(ids[0])
    raise ClusterError(f"profile {name!r} has no cluster of id ''; it has {', '.join(f'{name}:{c}' for c in ids)}"
                       + (f" ({', '.join(owned)} still owned by a running process)" if owned else "")
                       + f": `workbench down --profile {name}:ID` stops one")


def running(profile: str | None = None) -> list[dict[str, Any]]:
    """Every recorded cluster (of one profile, or of every profile under $IPYTHONDIR)."""
    from ipyparallel import ClusterManager

    if profile:
        kw: dict[str, Any] = {"profile_dir": profile_dir(profile)}
        if not os.path.isdir(kw["profile_dir"]):
            raise ClusterError(f"unknown profile {profile!r}: no profile directory {kw['profile_dir']}")
    else:  # every profile of the same directory `up` and `down` use (not IPython's per-process fallback)
        root = ipython_dir()
        dirs = sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("profile_")) \
            if os.path.isdir(root) else []
        if not dirs:
            return []
        kw = {"profile_dirs": dirs}
    logging.getLogger("ClusterManager").setLevel(logging.ERROR)
    rows = []
    for key, ipc in ClusterManager(log=logging.getLogger("ClusterManager")).load_clusters(**kw).items():
        try:
            with open(sidecar(ipc.profile_dir, ipc.cluster_id)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = {}
        started = meta.get("started") or min((float(k.split("-")[0]) for k in ipc.engines if k.split("-")[0].isdigit()),
                                             default=None)
        rows.append({"cluster": key, "running": ipc.controller is not None, "ranks": expected_engines(ipc),
                     "backend": meta.get("backend", "-"),
                     "age_s": None if started is None else time.time() - started})
    return rows
