"""The init phases as plain functions, for free-form ``%%px`` cells on the engines.

A Session runs scenario steps; these are the same instruments for a user's own model,
cell by cell: build on meta, materialise with tracking (and poison), sync module states
with every broadcast recorded, forward with a per-module trace, probe. Each returns what
a cell wants to look at; ``cluster.probe(...)`` gathers the tables in the client.

    %%px
    model = wbr.build_on_meta(MyModel, cfg)
    wbr.materialize(model, device)
    buckets = wbr.sync_module_states(model)
    out, trace = wbr.forward(model, batch)
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workbench.rank import context, ledger, poison, probe, trace


def here() -> tuple[int, int, torch.device]:
    """(rank, world_size, device) of this engine."""
    r = context._RANK
    return r["rank"], r["world_size"], r["device"]


def build_on_meta(factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``factory(*args, **kwargs)`` under the meta device: shapes and dtypes, no memory."""
    with torch.device("meta"):
        return factory(*args, **kwargs)


def materialize(module: nn.Module, device: torch.device | str | None = None, recurse: bool = True,
                poison_memory: bool = True) -> nn.Module:
    """``module.to_empty(...)`` with every handed-out tensor tracked (and poisoned with NaN bits).

    The probe's ``written`` column then says which tensors nobody wrote since.
    """
    with poison.poisoned(poison_memory):
        module.to_empty(device=device or here()[2], recurse=recurse)
    return module


def sync_module_states(module: nn.Module, src: int = 0, bucket_bytes: int = 250 * 1024 * 1024) -> list[dict]:
    """Broadcast parameters and buffers from ``src`` as FSDP1/DDP do, and return the calls made.

    Goes through ``torch.distributed.utils._sync_params_and_buffers`` (so through
    ``_broadcast_coalesced`` and its per-dtype buckets); the returned records show each
    bucket this rank issued: its dtype, element count and bytes.
    """
    from torch.distributed.utils import _sync_params_and_buffers

    states = [t.detach() for t in module.parameters()] + [b.detach() for b in module.buffers()]
    directory = tempfile.mkdtemp(prefix="wb-px-ledger-")
    book = ledger.Ledger(directory, here()[0], session="px")
    try:
        with ledger.recording(book, step="sync_module_states"):
            _sync_params_and_buffers(dist.group.WORLD, states, bucket_bytes, src)
    finally:
        book.close()
    with open(ledger.ledger_path(directory, here()[0])) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    os.remove(ledger.ledger_path(directory, here()[0]))
    os.rmdir(directory)
    return records


def forward(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, list[dict]]:
    """``model(*args, **kwargs)`` under no_grad, and one trace row per module call."""
    holder = SimpleNamespace(rank=here()[0])
    with torch.no_grad(), trace.trace_forward(holder, model):
        out = model(*args, **kwargs)
    return out, trace.take(holder)


def probe_rows(objects: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's probe rows for ``objects`` (modules, dicts of tensors, tensors)."""
    return probe.probe_objects(objects, here()[0])
