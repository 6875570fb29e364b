"""What a killed process leaves behind, and how to clear it once its owner is gone (stdlib only).

**Its own temp dirs.** A process that calls ``own_temp_paths()`` (every engine, at group formation; every
client, when it makes a cluster) writes each ``wb-*`` path it makes with ``tempfile`` in the temp dir to a
manifest named after its pid, ``wb-owned-<pid>-*.txt`` (``tempfile.mkdtemp``/``mkstemp`` note them: no call
site has to say so). A clean exit removes them; once the pid is gone, whoever sweeps next
(``stacks.sweep_stale``: the next engine to start, a ``stop()``, the reaper, ``down``) does: a rank's vLLM
checkpoint (``wb-vllm-*``), a session's ledger dir (``wb-ledger-*``), its work dirs. A lease dir is never
listed: its reaper must see it until the tree is ended.

**torch's shared memory.**

torch's ``file_system`` sharing (CPU tensors handed between processes by shared-memory name: the weight-sync
scenarios' IPC handles) starts a ``torch_shm_manager`` beside the process. The manager makes
``$TMPDIR/torch-shm-dir-XXXXXX/manager.sock`` and unlinks the segments (``/dev/shm/torch_<pid>_<n>_<i>``,
``<pid>`` the process that made them) when its last client is gone: a clean exit leaves nothing. Engines are
killed, and their managers with them (they carry the tree's marker), so each killed engine left a directory
in the temp dir and its segments in ``/dev/shm`` (RAM), for good. Here: who still owns them, and clearing
what no live process does.
"""

from __future__ import annotations

import atexit
import functools
import glob
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

SHM = "/dev/shm"
SEGMENT = re.compile(r"torch_(\d+)_\d+_\d+")
MANAGER_DIR = "torch-shm-dir-"
MANAGER_COMM = "torch_shm_manag"  # /proc/<pid>/comm keeps 15 characters
UNBOUND_GRACE_S = 10.0  # a manager's dir with no socket yet: one starting (mkdtemp, then bind), or one that died
SEGMENT_AGE_S = 60.0  # a segment of a dead pid that no process maps, left by someone else: how old before it goes
MANIFEST = re.compile(r"wb-owned-(\d+)-\w{8}\.txt")
NEVER = ("wb-lease-", "wb-owned-")  # a lease dir is its reaper's to remove; a manifest is not its own entry

_OWN: dict[str, Any] = {}
_LOCK = threading.Lock()


def own_temp_paths() -> str:
    """From now on, list every ``wb-*`` path this process makes with ``tempfile`` in the temp dir in a manifest
    named after its pid (see the module docstring); the manifest's path. Idempotent; a forked child lists none.

    ``tempfile.mkdtemp``/``mkstemp`` are wrapped (the result is the same; a ``wb-*`` name is noted). Python's
    audit events would need no wrapper, but an audit hook runs on every audited event of the process
    (``id()``, ``sys._getframe``...): ~2000 a step on a rank, ~0.6 us each measured."""
    if _OWN.get("pid") == os.getpid():
        return _OWN["path"]
    directory = tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix=f"wb-owned-{os.getpid()}-", suffix=".txt", dir=directory)
    with _LOCK:
        _OWN.update(pid=os.getpid(), path=path, dir=directory, fh=os.fdopen(fd, "a", buffering=1))
    if not _OWN.get("wrapped"):
        _OWN["wrapped"] = True
        real_mkdtemp, real_mkstemp = tempfile.mkdtemp, tempfile.mkstemp

        @functools.wraps(real_mkdtemp)
        def mkdtemp(*args: Any, **kwargs: Any) -> Any:
            made = real_mkdtemp(*args, **kwargs)
            _note(made)
            return made

        @functools.wraps(real_mkstemp)
        def mkstemp(*args: Any, **kwargs: Any) -> Any:
            made = real_mkstemp(*args, **kwargs)
            _note(made[1])
            return made

        tempfile.mkdtemp, tempfile.mkstemp = mkdtemp, mkstemp
        atexit.register(_at_exit)
    return path


def _note(path: Any) -> None:
    if _OWN.get("pid") != os.getpid():
        return
    try:
        path = os.fsdecode(path)
        name = os.path.basename(path)
        if name.startswith("wb-") and not name.startswith(NEVER) and os.path.dirname(path) == _OWN["dir"]:
            with _LOCK:
                _OWN["fh"].write(path + "\n")
    except (OSError, ValueError, TypeError):
        pass


def _at_exit() -> None:
    """A clean exit: what this process listed goes, and the manifest with it."""
    if _OWN.get("pid") == os.getpid():
        with _LOCK:
            _OWN["fh"].close()
            _OWN["pid"] = None
        remove_listed(_OWN["path"])


def remove(path: str) -> bool:
    """A file or a folder tree gone; False when it could not be removed (gone already, or not ours to remove)."""
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    except OSError:
        return False


def remove_listed(manifest: str) -> int:
    """Remove the paths a manifest lists (this user's, directly in its directory, never a link), then it."""
    directory = os.path.dirname(manifest)
    n = 0
    try:
        with open(manifest) as f:
            listed = [line.strip() for line in f if line.strip()]
    except OSError:
        listed = []
    for path in dict.fromkeys(listed):
        name = os.path.basename(path)
        if os.path.dirname(path) != directory or not name.startswith("wb-") or name.startswith(NEVER) \
                or os.path.islink(path) or not _mine(path):
            continue
        n += remove(path)
    try:
        os.unlink(manifest)
    except OSError:
        pass
    return n


def sweep_manifests(directory: str, gone: Any) -> int:
    """Remove what the manifests in ``directory`` of processes ``gone(pid)`` says are gone list."""
    n = 0
    for manifest in glob.glob(os.path.join(glob.escape(directory), "wb-owned-*.txt")):
        m = MANIFEST.fullmatch(os.path.basename(manifest))
        if m and not os.path.islink(manifest) and _mine(manifest) and gone(int(m.group(1))):
            n += remove_listed(manifest)
    return n


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()] if os.path.isdir("/proc") else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def _bound_socket_paths() -> set[str]:
    """Unix socket paths a live shm manager has bound, as each manager's own network namespace lists them
    (engines of the simulated hosts in tests/netns.py live in other namespaces but the same temp dir)."""
    paths: set[str] = set()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != MANAGER_COMM:
                    continue
            with open(f"/proc/{pid}/net/unix") as f:
                for line in f.readlines()[1:]:
                    parts = line.split()
                    if len(parts) >= 8:
                        paths.add(parts[7])
        except OSError:
            continue
    return paths


def _mine(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid()


def sweep_manager_dirs(directory: str) -> int:
    """Remove this user's ``torch-shm-dir-*`` in ``directory`` whose manager is gone; a live one's stay."""
    found = [d for d in glob.glob(os.path.join(glob.escape(directory), MANAGER_DIR + "*"))
             if os.path.isdir(d) and not os.path.islink(d) and _mine(d)]
    if not found:
        return 0
    bound = _bound_socket_paths()
    n = 0
    for d in found:
        sock = os.path.join(d, "manager.sock")
        if sock in bound or os.path.realpath(sock) in bound:
            continue
        try:
            if not os.path.exists(sock) and time.time() - os.lstat(d).st_mtime < UNBOUND_GRACE_S:
                continue  # a manager between making its dir and binding its socket
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        n += not os.path.exists(d)
    return n


def _mapped_segments() -> set[str]:
    """Names of the ``/dev/shm`` segments some live process maps (a receiver keeps a tensor its maker shared)."""
    names: set[str] = set()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(SHM + "/torch_")
                    if i >= 0:
                        names.add(os.path.basename(line[i:].split()[0]))
        except OSError:
            continue
    return names


def sweep_segments(pids: Iterable[int] | None = None, min_age: float = SEGMENT_AGE_S) -> int:
    """Unlink this user's torch segments in ``/dev/shm`` made by a process now gone that no live process maps.
    ``pids``: only those processes' (just killed by the caller: no age asked); None: any dead pid's, older
    than ``min_age`` seconds."""
    wanted = None if pids is None else {int(p) for p in pids}
    try:
        names = os.listdir(SHM)
    except OSError:
        return 0
    now = time.time()
    candidates = []
    for name in names:
        m = SEGMENT.fullmatch(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if (pid not in wanted) if wanted is not None else alive(pid):  # the caller's own: killed (a zombie, maybe)
            continue
        path = os.path.join(SHM, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid() or (wanted is None and now - st.st_mtime < min_age):
            continue
        candidates.append(path)
    if not candidates:
        return 0
    mapped = _mapped_segments()
    n = 0
    for path in candidates:
        if os.path.basename(path) in mapped:
            continue
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n


def sweep(directory: str, pids: Iterable[int] | None = None) -> int:
    """Both: dead managers' dirs in ``directory`` and dead processes' segments (see ``sweep_segments``)."""
    return sweep_manager_dirs(directory) + sweep_segments(pids)
