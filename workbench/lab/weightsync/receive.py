"""The inference worker's side of a colocated sync (vLLM's ``update_weights_ipc``).

The worker finds its own device's handle in the update request, rebuilds it, walks the
metadata in order cutting ``packed[off:off+size].view(shape)``, and loads each piece by
name into its own copy of the model. Nothing here knows which rank packed the buffer:
the metadata is trusted, so another rank's metadata cuts this buffer without complaint
whenever its sizes add up.

Bad input ends in one line naming the tensor: a handle that cannot be rebuilt, sizes that
do not add up to the buffer (or do not match a shape), a dtype other than the buffer's,
or a name the model does not have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from workbench.errors import WorkbenchError
from workbench.lab.weightsync import ipc
from workbench.lab.weightsync.pack import check_metadata, dtype_of


class ReceiveError(WorkbenchError):
    """The worker could not cut or load what it received."""


def slice_packed(packed: torch.Tensor, meta: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, packed[off:off+size].view(shape))`` in metadata order, checked first."""
    try:
        check_metadata(meta, packed.numel())
    except WorkbenchError as exc:
        raise ReceiveError(str(exc)) from None
    off = 0
    for name, dt, shape, size in zip(meta["names"], meta["dtype_names"], meta["shapes"], meta["sizes"]):
        if dtype_of(dt) != packed.dtype:
            raise ReceiveError(f"tensor {name!r}: metadata says {dt} but the buffer is "
                               f"{str(packed.dtype).replace('torch.', '')}")
        yield name, packed[off:off + size].view(shape)
        off += size


def update_weights_ipc(request: ipc.UpdateRequest, key: str, load: Callable[[str, torch.Tensor], None],
                       device: torch.device | str | None = None) -> list[str]:
    """Rebuild this device's handle, slice it by the request's metadata for it, load by name."""
    handle, meta = request.for_device(key)
    packed = ipc.rebuild(handle, device)
    names = []
    try:
        for name, t in slice_packed(packed, meta):
            try:
                load(name, t)
            except WorkbenchError as exc:
                raise ReceiveError(str(exc)) from None
            names.append(name)
    finally:
        del packed
    return names
