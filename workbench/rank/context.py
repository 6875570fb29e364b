"""The per-rank context a scenario step receives, and the engine's registry of them.

One engine process holds one rank of the process group for the life of the cluster, and
one context per session: steps put what they build (model, wrapper, outputs) on it so
the next step and the probe can find it.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from workbench.rank import control, stacks, state
from workbench.rank.columns import kernel_knobs

RESERVED = frozenset(
    {"rank", "world_size", "device", "backend", "fix", "params", "poison", "workdir", "group", "outputs",
     "output_extras", "notes", "expected", "rank_local"}
)


@dataclass
class RankContext:
    """What a step knows about where it runs; anything else a step sets is the step's own."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    fix: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    poison: bool = True
    workdir: str = ""
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    output_extras: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    expected: dict[str, torch.Tensor] = field(default_factory=dict)
    rank_local: set[str] = field(default_factory=set)

    def expect(self, name: str, value: torch.Tensor) -> None:
        """Declare what tensor ``name`` (as probed, e.g. 'model.router.expert_bias') should hold."""
        self.expected[name] = value.detach()

    def local(self, *keys: str) -> None:
        """Mark objects on ctx (by attribute name) as this rank's own: a shard or a role (an
        expert-parallel shard, an inference worker's copy), not a replica. Their tensors are
        then checked against their expected values, never against rank 0's (which may not
        have them at all)."""
        self.rank_local.update(keys)

    def output(self, name: str, tensor: torch.Tensor, *, same_on: Any = "learned", **extra: Any) -> None:
        """Record an output (logits, loss) to be probed after the step, with scalar extras. ``same_on``: the ranks
        it must agree across (``"world"``, a process group, a mesh, a list of ranks; None: this rank's own);
        left out, it is learned (a collective that synced it), else this rank's own: per-rank batches give
        per-rank outputs."""
        self.outputs[name] = tensor.detach()
        if same_on != "learned":
            from workbench.rank.agree import declared_output

            extra = {**extra, **declared_output(same_on)}
        self.output_extras[name] = extra

    def note(self, message: str) -> None:
        """A line for the frame: what this rank did that the tables cannot show."""
        self.notes.append(message)

    @property
    def group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def user_objects(self) -> dict[str, Any]:
        """Everything the steps attached, in the order they attached it."""
        return {k: v for k, v in vars(self).items() if k not in RESERVED and not k.startswith("_")}


_RANK: dict[str, Any] = state.RANK  # the same dict: low modules read it from rank.state
_SESSIONS: dict[str, RankContext] = {}


def set_rank(rank: int, world_size: int, backend: str, device: Any, timeout_s: float) -> None:
    """Where this process's rank sits (what ``%%px`` cells' ``wbr.here()`` and the ledger read): set by
    ``init_rank`` for a live engine, and by a job's breakpoint where no live group set it."""
    _RANK.update(rank=rank, world_size=world_size, backend=backend, device=device, timeout_s=timeout_s)


def rank_is_set() -> bool:
    """Whether a rank was set in this process (a live engine's ``init_rank``, or a breakpoint in progress)."""
    return bool(_RANK)


def clear_rank() -> None:
    """Forget the rank ``set_rank`` set (a job's breakpoint, once it returns)."""
    _RANK.clear()


def init_rank(rank: int, world_size: int, backend: str, port: int, timeout_s: float, addr: str = "127.0.0.1",
              local_index: int | None = None) -> dict[str, Any]:
    """Join the process group over a TCP store at ``addr`` (loopback unless the ranks span hosts) and pin
    this rank's device: GPU ``local_index`` on its host (the rank on one host), or GPU 0 when a launcher
    masked each engine to one GPU."""
    if backend == "nccl":
        index = rank if local_index is None else local_index
        if torch.cuda.device_count() == 1:
            index = 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "nccl":
        # The default (3) lets NCCL's watchdog kill the engine when a collective times out; 2 aborts
        # the communicators and leaves the process alive, so the same engine can re-form the group.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    where = control.start(addr, port)  # answers (stacks, abort) while this rank is stuck
    if backend == "gloo":
        gloo_interface(addr, where["host"])
    before = control.socket_fds()
    kw: dict[str, Any] = {}
    if bind_device(backend):
        kw["device_id"] = device
    dist.init_process_group(
        backend,
        store=rendezvous_store(addr, rank, world_size, port, timeout_s),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kw,
    )
    _FORMED.add(backend)
    control.remember_group_sockets(before, port)
    control.track_new_groups()  # a subgroup a %%px cell forms, outside any step, is released like a step's
    set_rank(rank, world_size, backend, device, timeout_s)
    return {"rank": rank, "pid": os.getpid(), "device": str(device), "host_device": _device_name(device),
            "stacks_file": stacks.install(), "control": where, "kernels": kernel_knobs()}


_FORMED: set[str] = set()  # backends this process has formed a world group with


def bind_device(backend: str) -> bool:
    """Whether to form the group eagerly, its NCCL communicator bound to this rank's GPU (``device_id``).

    Only the first time in a process. On torch 2.11 (NCCL 2.28) a world group formed eagerly a second time
    in the same process segfaults in ``split_group`` (``ncclCommSplit``), which ``init_device_mesh`` uses
    whenever the default group is bound: an HSDP mesh killed every engine on the run after the workbench
    re-formed the group (``scripts/hsdp_reform_repro.py``, 4 x H200). Formed lazily, the mesh takes
    ``new_group`` instead, which holds for any number of re-formations."""
    return backend == "nccl" and backend not in _FORMED


def new_group(ranks: list[int]) -> Any:
    """``dist.new_group`` whose gloo pairs the control thread knows, so a call stuck on the subgroup can be
    released like one on the world group (every rank of the world calls it, in the same order). A live engine
    tracks every ``dist.new_group`` so (``control.track_new_groups``); this makes sure of it anywhere."""
    control.track_new_groups()
    return dist.new_group(list(ranks))


def gloo_interface(rendezvous: str, own_addr: str) -> None:
    """Across hosts, make gloo use the interface this rank reaches rank 0 through.

    Left alone, gloo listens on the address this host's name resolves to: on a node whose
    /etc/hosts maps its name to 127.0.1.1 (Debian's default) that is loopback, which no peer on
    another host can dial (seen in tests/test_multihost.py); it only worked while the peers did
    not have to dial it. A user's ``GLOO_SOCKET_IFNAME`` is kept."""
    from workbench.rank.host import interface_of

    ours = _RANK.get("gloo_ifname")
    if os.environ.get("GLOO_SOCKET_IFNAME") not in (None, ours):
        return  # the user's choice
    name = None if rendezvous in ("127.0.0.1", "localhost", "::1") else interface_of(own_addr)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = _RANK["gloo_ifname"] = name
    elif ours:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
        _RANK.pop("gloo_ifname", None)


def rendezvous_store(addr: str, rank: int, world_size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The group's TCP store, listening on ``addr`` only (127.0.0.1 on one host).

    ``init_method="tcp://ADDR:PORT"`` connects to ADDR but its store listens on every
    interface (``::``), reachable from any address of the host. Rank 0 binds the socket itself
    to ``addr`` and hands the store its descriptor; the store owns and closes it. Across hosts
    ``addr`` is rank 0's address on the interface the others reach, and only that one.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(max(128, world_size))
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(addr, port, world_size, True, timeout=timeout, master_listen_fd=sock.detach())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def destroy_rank() -> None:
    _SESSIONS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
        return
    # An init that failed part-way (its store unreachable) still counted its group on this rank and not on a rank
    # that failed sooner: the next group's store keys would differ between them ("/1/..." against "/0/..."), as
    # destroy_process_group would have reset the count.
    try:
        dist.distributed_c10d._world.group_count = 0
    except AttributeError:  # a torch whose private world keeps no such count: nothing to reset
        pass


def new_context(session_id: str, fix: str | None, params: dict[str, Any], poison: bool) -> RankContext:
    """A fresh context for one session; an earlier one of the same id is dropped."""
    old = _SESSIONS.pop(session_id, None)
    del old
    # the pid in the name: a killed engine's dir is found and swept by the next engine (stacks.sweep_stale)
    workdir = tempfile.mkdtemp(prefix=f"wb-{session_id}-r{_RANK['rank']}-p{os.getpid()}-")
    ctx = RankContext(
        rank=_RANK["rank"],
        world_size=_RANK["world_size"],
        device=_RANK["device"],
        backend=_RANK["backend"],
        fix=fix,
        params=dict(params),
        poison=poison,
        workdir=workdir,
    )
    _SESSIONS[session_id] = ctx
    return ctx


def get_context(session_id: str) -> RankContext:
    try:
        return _SESSIONS[session_id]
    except KeyError:
        raise KeyError(f"no session {session_id!r} on rank {_RANK.get('rank')}; was the cluster restarted?") from None


def drop_context(session_id: str) -> None:
    _SESSIONS.pop(session_id, None)
