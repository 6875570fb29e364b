"""The colocated transport: a handle per packed buffer, gathered, and rank 0's one update request.

``torch.multiprocessing.reductions.reduce_tensor`` turns a tensor into ``(rebuild, args)``:
on CUDA ``args`` carry a CUDA IPC memory handle (another process on the same GPU maps the
same memory with ``cudaIpcOpenMemHandle``); on CPU they carry the tensor's storage, which
pickles, under the ``file_system`` sharing strategy, to the name of a shared-memory segment
that another process on the host maps. Both pickle to bytes here (``Handle.payload``), so
one code path ships them through ``all_gather_object`` / ``broadcast_object_list``.

A CUDA IPC handle cannot be opened by the process that made it (``cudaIpcOpenMemHandle``
fails there), which is why the inference worker that reads trainer rank ``r``'s buffer
must be another process on the same device: the scenarios host worker ``w`` in the engine
of rank ``(w + 1) % world``, on device ``w`` (``worker_device`` / ``host_of``).

The update request is what rank 0 fans out (SkyRL's HTTP ``collective_rpc``):
``UpdateRequest(handles={device id: handle}, shared=rank 0's metadata)`` before PR #1816,
``UpdateRequest(handles=..., per_device={device id: its own metadata})`` after it.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from workbench.errors import WorkbenchError


class HandleError(WorkbenchError):
    """A handle that cannot be rebuilt into a tensor on this process."""


@dataclass
class Handle:
    """A pickled ``reduce_tensor`` of one packed buffer, and what it should rebuild to."""

    device: str  # "cuda:1" / "cpu"
    payload: bytes
    numel: int
    dtype_name: str
    first_name: str = ""  # the first tensor packed in it, for error lines

    def __repr__(self) -> str:
        return f"Handle({self.device}, {self.numel} x {self.dtype_name}, {len(self.payload)} B)"


@dataclass
class UpdateRequest:
    """Rank 0's request to every inference worker: all handles, and the slicing metadata."""

    handles: dict[str, Handle]
    shared: dict[str, Any] | None = None  # one metadata for every worker (rank 0's)
    per_device: dict[str, dict[str, Any]] = field(default_factory=dict)  # each device's own

    def for_device(self, key: str) -> tuple[Handle, dict[str, Any]]:
        if key not in self.handles:
            raise HandleError(f"the update request has no handle for device {key!r} "
                              f"(it has: {', '.join(self.handles) or 'none'})")
        meta = self.per_device.get(key, self.shared)
        if meta is None:
            raise HandleError(f"the update request carries no slicing metadata for device {key!r}")
        return self.handles[key], meta


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU storages pickle to a shared-memory name (not a file descriptor unrelated processes cannot get)."""
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(old)


def make_handle(packed: torch.Tensor, first_name: str = "") -> Handle:
    """``reduce_tensor(packed)`` pickled: a CUDA IPC handle on GPU, a shared-memory name on CPU."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    with _file_system_sharing():
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(reduce_tensor(packed))
    dev = str(packed.device) if packed.device.type != "cuda" else f"cuda:{packed.device.index}"
    return Handle(dev, buf.getvalue(), packed.numel(), str(packed.dtype).replace("torch.", ""), first_name)


def rebuild(handle: Handle, device: torch.device | str | None = None) -> torch.Tensor:
    """The tensor behind ``handle``, mapped into this process (on ``device`` for a CUDA handle)."""
    what = f"the {handle.device} buffer" + (f" starting with tensor {handle.first_name!r}" if handle.first_name else "")
    try:
        func, args = pickle.loads(handle.payload)
        if handle.device.startswith("cuda"):
            args = list(args)
            d = torch.device(device) if device is not None else torch.device(handle.device)
            args[6] = d.index if d.index is not None else torch.cuda.current_device()  # storage_device
        t = func(*args)
    except (pickle.UnpicklingError, EOFError, ImportError, AttributeError, IndexError, TypeError, ValueError, OSError,
            RuntimeError) as exc:  # a payload that does not unpickle to torch's rebuild call; a buffer it cannot map
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HandleError(f"cannot rebuild the IPC handle of {what}: {type(exc).__name__}: {msg}") from None
    if t.numel() != handle.numel:
        raise HandleError(f"the IPC handle of {what} rebuilt {t.numel()} elements, expected {handle.numel}")
    return t


def device_key(device: torch.device | str, rank: int) -> str:
    """The id a worker finds its own handle by (vLLM: the GPU's UUID; here: device and rank)."""
    d = torch.device(device)
    if d.type == "cuda":
        return f"cuda:{d.index}"
    return f"cpu:{rank}"


def worker_device(ctx_device: torch.device, rank: int, world: int) -> tuple[int, torch.device]:
    """Inference worker hosted by this engine, on the device of trainer rank ``worker``.

    The worker reading trainer rank ``w``'s buffer must be another process on ``w``'s device, and a
    CUDA IPC handle (a shared-memory segment on CPU) never crosses hosts: ranks pair up, worker
    ``rank ^ 1`` on rank ``rank``, so partners are neighbours in rank order (one host when each host
    holds an even number of ranks, as launchers lay them out). An odd world falls back to a ring.
    """
    w = (rank - 1) % world if world % 2 else rank ^ 1  # the pairing is its own inverse (see host_of)
    dev = torch.device("cuda", ctx_device.index + (w - rank)) if ctx_device.type == "cuda" else ctx_device
    return w, dev


def host_of(worker: int, world: int) -> int:
    """The engine rank hosting inference worker ``worker`` (see ``worker_device``)."""
    return (worker + 1) % world if world % 2 else worker ^ 1


def gather_handles(entry: dict[str, Any], group: Any = None,
                   device: torch.device | None = None) -> list[dict[str, Any]]:
    """``all_gather_object`` of every rank's ``{device id: handle or {handle, metadata}}``."""
    out: list[Any] = [None] * dist.get_world_size(group)
    _objects(lambda: dist.all_gather_object(out, entry, group=group), device)
    return out


def broadcast_request(request: UpdateRequest | None, src: int = 0, group: Any = None,
                      device: torch.device | None = None) -> UpdateRequest:
    """Rank 0's single update request reaches every worker (stands for the HTTP fan-out)."""
    box = [request]
    _objects(lambda: dist.broadcast_object_list(box, src=src, group=group,
                                                device=device if _is_cuda(device) else None), device)
    return box[0]


def _is_cuda(device: torch.device | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _objects(fn, device: torch.device | None) -> None:
    """Object collectives on NCCL stage through the current CUDA device: make it the rank's own."""
    if _is_cuda(device):
        with torch.cuda.device(torch.device(device)):
            fn()
    else:
        fn()


def request_rank0_metadata(gathered: list[dict[str, Any]]) -> UpdateRequest:
    """Before the fix: every handle, but only rank 0's metadata for all of them."""
    handles = {k: v["handle"] for entry in gathered for k, v in entry.items()}
    first = next(iter(gathered[0].values()))
    return UpdateRequest(handles, shared=first["metadata"])


def request_per_rank(gathered: list[dict[str, Any]]) -> UpdateRequest:
    """PR #1816: every device's handle with its own metadata."""
    handles = {k: v["handle"] for entry in gathered for k, v in entry.items()}
    per = {k: v["metadata"] for entry in gathered for k, v in entry.items()}
    return UpdateRequest(handles, per_device=per)
