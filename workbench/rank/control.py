"""A rank's control path: it answers while the engine's main thread is blocked in a collective.

An ipyparallel engine runs one task at a time on its main thread, so a rank stuck in a
collective cannot be asked anything through the engine, and restarting the engine costs
the whole warm state (measured 27.5 s on 2 x H200). A daemon thread started when the rank
joins its group listens on one socket and can release the blocked call instead:

- NCCL: every group's backend is aborted (``ProcessGroup.abort``); the kernels see the abort
  flag and exit, so the host sync the main thread waits in returns and the collective raises.
  torch's registry of groups is left as it was: ``c10d._abort_process_group()`` on the world
  also clears it and the default group, so a rank's later call on a subgroup it kept would raise
  ``ValueError: Group ... is not registered`` (an artefact of the release, not of the incident);
  with the registry kept it raises "NCCL communicator was aborted", the hang's symptom.
  The group is re-formed by ``destroy_process_group`` as after any failed step.
- gloo: aborting its group object does not wake a waiter, but gloo's pairs are plain TCP
  sockets: shutting them down (they were opened while the group formed, so we know which)
  makes every pending send or receive fail at once, on this rank and on its peers.

The client then re-forms the group on the same engines. The socket listens on loopback
when the group does (one host) and otherwise only on the address this rank uses to reach
rank 0; every request must carry the token the client got from ``init_rank``.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import sys
import threading
import time
import traceback
from typing import Any

from workbench.rank import patch

_STATE: dict[str, Any] = {"group_sockets": {}}


def start(rendezvous_addr: str, rendezvous_port: int) -> dict[str, Any]:
    """Start the control thread once per process; where and how to reach it (host, port, token)."""
    if _STATE.get("port"):
        return {"host": _STATE["host"], "port": _STATE["port"], "token": _STATE["token"]}
    host = bind_address(rendezvous_addr, rendezvous_port)
    srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, 0))
    srv.listen(8)
    _STATE.update(host=host, port=srv.getsockname()[1], token=secrets.token_hex(16))
    threading.Thread(target=_serve, args=(srv,), name="workbench-control", daemon=True).start()
    warm_probe()
    return {"host": _STATE["host"], "port": _STATE["port"], "token": _STATE["token"]}


def warm_probe() -> bool:
    """On a rank whose CUDA device is set (an NCCL rank joining its group), build the GPU probe's kernel in
    the background (``probe_fused.warm_async``): the first probe then takes ~0.1 s, not Triton's import and
    compile (seconds). Once per process, as ``start`` is; never on a CPU rank."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    try:
        from workbench.rank import probe_fused

        return probe_fused.warm_async() is not None
    except (ImportError, RuntimeError):  # no numpy/Triton here, no CUDA device to ask: built on first use instead
        return False


def bind_address(rendezvous_addr: str, rendezvous_port: int) -> str:
    """Loopback when the group is on loopback; else this host's address on the route to rank 0."""
    if rendezvous_addr in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET6 if ":" in rendezvous_addr else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((rendezvous_addr, rendezvous_port or 9))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]
    finally:
        probe.close()


REQUEST_S = 5.0  # a request must arrive whole within this (one slow or idle client cannot hold the thread)
MAX_REQUEST = 64 * 1024  # bytes: a request is a short JSON line


def _serve(srv: socket.socket) -> None:
    """Accept forever; each connection is answered on its own short-lived thread, so a client that holds a
    connection open (a byte every few seconds) delays no one else's ``ping`` or ``abort``."""
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:  # out of file descriptors, say: the control path must outlive it
            time.sleep(0.1)
            continue
        threading.Thread(target=_answer, args=(conn,), name="workbench-control-conn", daemon=True).start()


def _read_request(conn: socket.socket, deadline: float) -> bytes:
    """One request line, whole by ``deadline`` and at most ``MAX_REQUEST`` bytes, or an error."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            conn.settimeout(left)
            chunk = conn.recv(4096)
        except TimeoutError:
            raise TimeoutError(f"request not complete within {REQUEST_S:g} s") from None
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST:
            raise ValueError(f"request longer than {MAX_REQUEST} bytes")
    return buf.split(b"\n", 1)[0]


def _answer(conn: socket.socket) -> None:
    with conn:
        try:
            req = json.loads(_read_request(conn, time.monotonic() + REQUEST_S) or b"{}")
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
            if not hmac.compare_digest(str(req.get("token", "")), _STATE["token"]):
                reply: dict[str, Any] = {"error": "wrong token"}
            else:
                reply = handle(str(req.get("cmd", "")), req)
        except Exception as exc:  # a boundary: the control path never dies of one bad request; the reply says it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            conn.settimeout(REQUEST_S)
            conn.sendall(json.dumps(reply, default=str).encode() + b"\n")
        except OSError:
            pass


def handle(cmd: str, req: dict[str, Any] | None = None) -> dict[str, Any]:
    """One command: ``ping``, ``stacks``, ``mark``, ``abort``, ``interrupt`` or ``tail`` (a ledger file's new
    bytes)."""
    if cmd == "ping":
        return {"ok": True, "pid": os.getpid()}
    if cmd == "stacks":
        return {"stacks": stacks()}
    if cmd == "mark":
        return mark()
    if cmd == "abort":
        return abort()
    if cmd == "tail":
        return tail(str((req or {}).get("path", "")), int((req or {}).get("offset", 0)))
    if cmd == "interrupt":
        return interrupt()
    return {"error": f"unknown control command {cmd!r}; known: ping, stacks, mark, abort, interrupt, tail"}


TAIL_MAX = 4 << 20  # bytes of one reply; the client asks again for the rest


def tail(path: str, offset: int) -> dict[str, Any]:
    """A ledger file's bytes from ``offset``, for a client on another host (it cannot read this host's
    /tmp). Only ``rank<N>.jsonl`` in a ``wb-ledger-*`` directory of this host's temp dir is served."""
    import base64
    import re
    import tempfile

    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    if not (re.fullmatch(r"rank\d+\.jsonl", os.path.basename(real)) and os.path.basename(parent).startswith(
            "wb-ledger-") and os.path.dirname(parent) == os.path.realpath(tempfile.gettempdir())):
        return {"error": f"not a ledger file: {path}"}
    try:
        with open(real, "rb") as f:
            f.seek(max(0, offset))
            data = f.read(TAIL_MAX)
    except FileNotFoundError:
        data = b""
    return {"data": base64.b64encode(data).decode()}


class StepInterrupted(BaseException):
    """Raised in a step's thread by ``interrupt``: not an Exception, so a step's loop that catches every
    Exception does not swallow it."""


def in_step(step: str | None) -> None:
    """The step runner says a step's own code starts (its name) or ended (None) on this thread. From the end
    of a step's code to the start of the next, Python's automatic collection is paused (``pause_gc``)."""
    _STATE["step"] = (threading.get_ident(), step) if step is not None else None
    if step is None:
        pause_gc()
    else:
        resume_gc()


GC_RESUME_S = 1.0  # automatic collection comes back this long after a step's code ended, if no step began first


def pause_gc() -> bool:
    """Pause automatic collection while the workbench probes and replies. A full collection walks the
    whole heap (a rank holding a transformers model: 0.2-0.3 s on an H200 host); a 0.2-0.4 s pause fell inside a
    probe in 4 of 6 runs of benchmarks/real_size.py at 4 GPUs (the probe's thousands of rows make collections
    due), and timed it was a full collection (304 ms of a 329 ms probe, fixtures/gpu/real_size_gc.json); none in
    40 steps since. The rows die by refcount once the reply is sent, so they never reach an old
    generation; the user's code runs with collection as before (a collection it makes due happens there, in its
    own time). ``gc.collect()`` still works meanwhile; collection resumes when the next step starts or
    ``GC_RESUME_S`` later; a user's own ``gc.disable()`` is left alone."""
    import gc

    if not gc.isenabled() or "gc_paused" in _STATE:
        return False
    gc.disable()
    timer = threading.Timer(GC_RESUME_S, resume_gc)
    timer.daemon = True
    _STATE["gc_paused"] = timer
    timer.start()
    return True


def resume_gc() -> None:
    """Automatic collection back on, if ``pause_gc`` paused it (once, from whichever thread comes first)."""
    import gc

    timer = _STATE.pop("gc_paused", None)
    if timer is None:
        return
    timer.cancel()
    gc.enable()


def interrupt() -> dict[str, Any]:
    """Raise ``StepInterrupted`` in a step still running Python (a loop no abort reaches: it waits on no
    socket), so the same engine comes back instead of being replaced after the collective timeout."""
    import ctypes

    running = _STATE.get("step")
    if not running:
        return {"interrupted": False, "why": "no step running"}
    ident, step = running
    mark()
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(StepInterrupted))
    return {"interrupted": n == 1, "step": step}


def mark() -> dict[str, Any]:
    """Say that this rank's group is about to be aborted, before any rank aborts: on gloo an idle
    rank cutting its sockets wakes a stuck peer ("Connection closed by peer") before that peer's
    own abort arrives, and the peer's ledger must still put the failure down to the recovery."""
    _STATE["aborted"] = True
    return {"marked": True}


def stacks() -> dict[str, str]:
    """Every thread's Python stack, the main thread first, the control threads left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out: dict[str, str] = {}
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main):
        if not names.get(ident, "").startswith("workbench-control"):
            out[names.get(ident, str(ident))] = "".join(traceback.format_stack(frame))
    return out


# -- the group's sockets --------------------------------------------------------------------
def socket_fds() -> dict[int, str]:
    """This process's open sockets: fd -> 'socket:[inode]' (Linux /proc; empty elsewhere)."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def remember_group_sockets(before: dict[int, str], store_port: int | None = None, add: bool = False) -> int:
    """Keep the connected sockets that appeared while the group formed, but not the store's:
    those are gloo's pairs. (Cutting the store's connections kills the process: its server
    thread does not survive a reset peer.) ``add``: a subgroup of the current group formed
    (``dist.new_group``): its pairs join the ones an abort cuts, or a call stuck on it could not be released."""
    store_port = _STATE.get("store_port") if store_port is None else store_port
    _STATE["store_port"] = store_port
    after = socket_fds()
    group = dict(_STATE.get("group_sockets", {})) if add else {}
    for fd, ino in after.items():
        if before.get(fd) == ino:
            continue
        ends = _ends(fd)
        if ends is not None and store_port not in ends and _STATE.get("port") not in ends:
            group[fd] = ino
    _STATE["group_sockets"] = group
    if not add:
        _STATE["aborted"] = False  # a fresh group: nothing of it was aborted
    return len(group)


def track_new_groups() -> bool:
    """From now on, every subgroup this process forms, wherever it forms it (a step, a ``%%px`` cell before any
    step, ``new_subgroups``, a ``DeviceMesh``'s dims: all go through c10d's ``_new_group_with_tag``), has its gloo
    pairs join the sockets an abort cuts. Without it a proven deadlock on a group formed outside a step is
    declared but never released: the abort cuts only the pairs it knows and the waiters sit until the collective
    timeout. A live engine installs it once, when it joins its group (``context.init_rank``); never a user's job
    (a guest leaves c10d as it found it). NCCL needs none of it: its abort reaches every registered group.
    True where this call installed it."""
    from torch.distributed import distributed_c10d as c10d

    current = getattr(c10d, "_new_group_with_tag", None)
    if current is None or tracks_new_groups():
        return False
    c10d._new_group_with_tag = group_tracker(current)
    return True


def tracks_new_groups() -> bool:
    """Whether ``track_new_groups`` is on in this process."""
    from torch.distributed import distributed_c10d as c10d

    return bool(getattr(getattr(c10d, "_new_group_with_tag", None), "tracks_groups", False))


def group_tracker(original: Any) -> Any:
    """``original`` (c10d's ``_new_group_with_tag``) with the group's new sockets remembered (``add=True``)."""
    def _new_group_with_tag(*args: Any, **kwargs: Any) -> Any:
        before = socket_fds()
        group = original(*args, **kwargs)
        try:
            remember_group_sockets(before, add=True)
        except Exception:  # a boundary on the job's thread: never fail its group for the sake of a release
            pass  # silent: no one to tell here; a call on that group then waits out its timeout, as without us
        return group

    _new_group_with_tag.__wrapped__ = original  # type: ignore[attr-defined]
    _new_group_with_tag.tracks_groups = True  # type: ignore[attr-defined]
    return patch.unseen(_new_group_with_tag)


def _ends(fd: int) -> tuple[int, int] | None:
    """(local port, peer port) of a connected TCP socket; None for anything else."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return s.getsockname()[1], s.getpeername()[1]
    except (OSError, IndexError, TypeError):
        return None  # a listener, or not connected
    finally:
        s.close()


def _shutdown_group_sockets() -> int:
    """Shut down (not close: the group still owns the fds) every socket of the group still open."""
    now, n = socket_fds(), 0
    for fd, ino in _STATE.get("group_sockets", {}).items():
        if now.get(fd) != ino:  # closed since, or the number reused by someone else: not ours
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass  # a listening or never-connected socket
        finally:
            s.close()
    return n


def abort() -> dict[str, Any]:
    """Release a call blocked in this rank's process groups; the group is unusable afterwards."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    t0 = time.perf_counter()
    if not dist.is_initialized():
        return {"aborted": False, "why": "no process group"}
    mark()  # the calls it releases fail because of us: the ledger says so
    backend = str(dist.get_backend())
    done: list[str] = []
    if backend == "nccl":
        try:
            groups = sorted(c10d._world.pg_names, key=lambda g: c10d._world.pg_names[g], reverse=True)
            n = abort_groups(groups, c10d._get_default_group())
            done.append(f"aborted the NCCL communicators of {n} group(s)")
        except (RuntimeError, ValueError, AttributeError) as exc:  # c10d's refusal, a torch without the table
            return {"aborted": False, "why": f"abort: {type(exc).__name__}: {exc}"}
    else:  # NCCL's own sockets are its business; gloo's pairs are ours to cut
        done.append(f"shut down {_shutdown_group_sockets()} group socket(s)")
    _STATE["group_sockets"] = {}
    return {"aborted": True, "backend": backend, "did": done, "seconds": time.perf_counter() - t0}


def abort_groups(groups: list[Any], default: Any) -> int:
    """Abort each group's backends, the registry untouched (``c10d._abort_process_group`` minus its
    clearing of ``_world``). Inside one ncclGroupStart/End on the default group's NCCL backend, as torch
    does it: one communicator's abort must not wait on another's (pytorch#119797)."""
    import torch

    try:
        nccl = default._get_backend(torch.device("cuda"))
    except (RuntimeError, AttributeError):
        nccl = None
    grouped = nccl is not None and hasattr(nccl, "_group_start")
    if grouped:
        nccl._group_start()
    try:
        for pg in groups:
            if hasattr(pg, "abort"):
                pg.abort()
            else:  # an older ProcessGroup: its CUDA backend is the NCCL one
                pg._get_backend(torch.device("cuda")).abort()
    finally:
        if grouped:
            nccl._group_end()
    return len(groups)


def aborted() -> bool:
    """Whether this rank's current group was aborted by the control thread (its failures are ours)."""
    return bool(_STATE.get("aborted"))


def ask(where: dict[str, Any], cmd: str, timeout: float = 3.0, **args: Any) -> dict[str, Any]:
    """Client side: one command (and its ``args``) to a rank's control thread; its reply, or the error as a dict."""
    try:
        with socket.create_connection((where["host"], where["port"]), timeout=timeout) as s:
            s.sendall(json.dumps({**args, "cmd": cmd, "token": where["token"]}).encode() + b"\n")
            data = s.makefile("rb").readline()
        return json.loads(data) if data else {"error": "no reply"}
    except (OSError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
