"""The packed broadcast of a weight sync (non-colocated path): bytes travel, names do not.

Modelled on vLLM's ``packed_nccl_broadcast_producer`` / ``packed_nccl_broadcast_consumer``.
The producer (the trainer's sender, rank ``src`` of the transfer group) views every
streamed tensor as ``uint8``, appends it to the current buffer, and once the buffer holds
at least ``threshold`` bytes concatenates and broadcasts it. The consumer (an inference
worker) never sees the producer's names: it walks the *plan* (the metadata's names,
dtype names and shapes), sizes each entry as ``prod(shape) * itemsize``, cuts buffers by
the same rule, receives each, splits it, views every piece as its dtype and shape and
loads it under the plan's name.

So the two sides agree only if the stream yields exactly what the plan lists, in the
same order. A permutation with equal byte totals passes silently (bytes land under the
wrong names); a different cut means mis-sized broadcasts.

``check=True`` is the cheap insurance: before each buffer's bytes the producer also
broadcasts that buffer's ``(name, dtype, shape)`` list, and both sides run
``check_streamed_names`` against the plan, so a disagreement raises the same
``StreamPlanMismatch`` on both, at the first mismatching index, before anything is loaded.

The producer is split in two on purpose: ``pack_stream`` cuts (no communication) and
``send_packed`` broadcasts; ``produce`` chains them the way vLLM streams. A caller whose
process also plays a worker can pack first and send later: same bytes, same cuts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from workbench.errors import WorkbenchError
from workbench.lab.weightsync.defaults import DEFAULT_THRESHOLD
from workbench.lab.weightsync.pack import dtype_name, dtype_of


class StreamPlanMismatch(WorkbenchError):
    """The streamed tensors disagree with the receiver's plan (raised on sender and receiver alike)."""

    def __init__(self, index: int, planned: str | None, streamed: str | None, what: str = "name"):
        self.index, self.planned, self.streamed, self.what = index, planned, streamed, what
        p = "<end of plan>" if planned is None else repr(planned)
        s = "<end of stream>" if streamed is None else repr(streamed)
        super().__init__(f"weight stream disagrees with the plan at index {index}: streamed {what} {s}, "
                         f"the plan says {p}")


@dataclass
class Plan:
    """The receiver's slice plan: what ``get_weight_metadata`` returns (names, dtype names, shapes)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Plan:
        names, dts, shapes = list(meta["names"]), list(meta["dtype_names"]), [list(s) for s in meta["shapes"]]
        if not (len(names) == len(dts) == len(shapes)):
            raise WorkbenchError(f"weight metadata lists {len(names)} names, {len(dts)} dtypes, {len(shapes)} shapes")
        return cls(names, dts, shapes)

    def to_metadata(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtype_names": list(self.dtype_names),
                "shapes": [list(s) for s in self.shapes]}

    def nbytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * dtype_of(self.dtype_names[i]).itemsize

    def entries(self) -> list[tuple[str, str, list[int]]]:
        return list(zip(self.names, self.dtype_names, self.shapes))

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class PackedBuffer:
    """One broadcast's worth of bytes and what the producer put in it (the names stay home)."""

    index: int
    first: int  # stream index of its first tensor
    entries: list[tuple[str, str, list[int]]]  # (name, dtype name, shape) in stream order
    data: torch.Tensor  # uint8

    @property
    def names(self) -> list[str]:
        return [e[0] for e in self.entries]


@dataclass
class Transfer:
    """What one side did: its buffers (first index, count, bytes) and the names it streamed or loaded."""

    role: str
    buffers: list[dict[str, Any]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(b["bytes"] for b in self.buffers)


# -- producer -----------------------------------------------------------------------------
def stream_tensors(chunks: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten ``WeightChunk``-like objects (``.names``, ``.tensors``) or ``(name, tensor)`` pairs."""
    for chunk in chunks:
        if isinstance(chunk, tuple) and len(chunk) == 2 and isinstance(chunk[1], torch.Tensor):
            yield chunk
            continue
        yield from zip(chunk.names, chunk.tensors)


def pack_stream(chunks: Iterable[Any], threshold: int = DEFAULT_THRESHOLD) -> Iterator[PackedBuffer]:
    """The producer's cuts: uint8 views appended until a buffer holds ``threshold`` bytes."""
    parts: list[torch.Tensor] = []
    entries: list[tuple[str, str, list[int]]] = []
    size = first = count = index = 0
    for name, t in stream_tensors(chunks):
        parts.append(t.detach().contiguous().view(-1).view(torch.uint8))
        entries.append((name, dtype_name(t.dtype), list(t.shape)))
        size += parts[-1].numel()
        count += 1
        if size >= threshold:
            yield PackedBuffer(index, first, entries, torch.cat(parts))
            index, first, parts, entries, size = index + 1, count, [], [], 0
    if parts:
        yield PackedBuffer(index, first, entries, torch.cat(parts))


def send_packed(buffers: Iterable[PackedBuffer], *, group: Any = None, src: int = 0, plan: Plan | None = None,
                check: bool = False, threshold: int = DEFAULT_THRESHOLD,
                device: torch.device | None = None) -> Transfer:
    """Broadcast each buffer from ``src``; with ``check``, its entries first, checked against ``plan``."""
    if check and plan is None:
        raise WorkbenchError("check=True needs the plan the receivers slice with")
    cuts = plan_cuts(plan, threshold) if check else []
    out = Transfer("sender")
    for k, buf in enumerate(buffers):
        if check:
            _send_entries(buf.entries, group, src, device)
            check_buffer(plan, cuts, k, buf.entries)
        data = buf.data if device is None else buf.data.to(device)
        dist.broadcast(data, src=src, group=group)
        out.buffers.append({"buffer": buf.index, "first": buf.first, "count": len(buf.entries),
                            "bytes": int(buf.data.numel())})
        out.names += buf.names
    if check:
        _send_entries([], group, src, device)  # end of stream
        check_buffer(plan, cuts, len(out.buffers), [])
    return out


def produce(chunks: Iterable[Any], *, group: Any = None, src: int = 0, threshold: int = DEFAULT_THRESHOLD,
            plan: Plan | None = None, check: bool = False, device: torch.device | None = None) -> Transfer:
    """vLLM's streaming producer: cut and broadcast as the chunks come."""
    return send_packed(pack_stream(chunks, threshold), group=group, src=src, plan=plan, check=check,
                       threshold=threshold, device=device)


# -- consumer -----------------------------------------------------------------------------
def plan_cuts(plan: Plan, threshold: int = DEFAULT_THRESHOLD) -> list[tuple[int, int]]:
    """The consumer's cuts from the plan alone: ``(first index, end index)`` per buffer."""
    cuts, first, size = [], 0, 0
    for i in range(len(plan)):
        size += plan.nbytes(i)
        if size >= threshold:
            cuts.append((first, i + 1))
            first, size = i + 1, 0
    if first < len(plan):
        cuts.append((first, len(plan)))
    return cuts


def consume(plan: Plan, load: Callable[[str, torch.Tensor], None], *, group: Any = None, src: int = 0,
            threshold: int = DEFAULT_THRESHOLD, device: torch.device | str = "cpu", check: bool = False) -> Transfer:
    """vLLM's consumer: receive buffers cut from the plan, split, view, load under the plan's names."""
    out = Transfer("receiver")
    cuts = plan_cuts(plan, threshold)
    for k, (lo, hi) in enumerate(cuts):
        if check:
            check_buffer(plan, cuts, k, _recv_entries(group, src, device))
        sizes = [plan.nbytes(i) for i in range(lo, hi)]
        data = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(data, src=src, group=group)
        for i, piece in zip(range(lo, hi), data.split(sizes)):
            load(plan.names[i], piece.view(dtype_of(plan.dtype_names[i])).view(plan.shapes[i]))
            out.names.append(plan.names[i])
        out.buffers.append({"buffer": k, "first": lo, "count": hi - lo, "bytes": sum(sizes)})
    if check:
        check_buffer(plan, cuts, len(cuts), _recv_entries(group, src, device))
    return out


# -- the check ----------------------------------------------------------------------------
def check_streamed_names(plan: Plan | Sequence[str], streamed: Sequence[Any], start: int = 0) -> None:
    """Raise ``StreamPlanMismatch`` at the first index where ``streamed`` departs from the plan.

    ``streamed``: names, or ``(name, dtype name, shape)`` entries, beginning at plan index
    ``start``. Names first; with entries and a ``Plan`` also the dtype and the shape, which
    decide the byte sizes. A whole stream checked at once (``start=0``) must also end where
    the plan ends.
    """
    names = plan.names if isinstance(plan, Plan) else list(plan)
    entries = [(e, None, None) if isinstance(e, str) else tuple(e) for e in streamed]
    for k, (name, dt, shape) in enumerate(entries):
        i = start + k
        planned = names[i] if i < len(names) else None
        if planned != name:
            raise StreamPlanMismatch(i, planned, name)
        if isinstance(plan, Plan) and dt is not None and (dt, list(shape)) != (plan.dtype_names[i], plan.shapes[i]):
            raise StreamPlanMismatch(i, f"{planned} {plan.dtype_names[i]} {plan.shapes[i]}",
                                     f"{name} {dt} {list(shape)}", what="entry")
    if start == 0 and len(entries) < len(names):
        raise StreamPlanMismatch(len(entries), names[len(entries)], None)


def check_buffer(plan: Plan, cuts: list[tuple[int, int]], k: int, entries: Sequence[Any]) -> None:
    """Buffer ``k`` as streamed against the ``k``-th cut of the plan (``entries == []``: stream ended).

    Sender and receiver run this on the same inputs, so both raise the same error.
    """
    if k >= len(cuts):
        if entries:
            raise StreamPlanMismatch(len(plan), None, _entry_name(entries[0]))
        return
    lo, hi = cuts[k]
    if not entries:
        raise StreamPlanMismatch(lo, plan.names[lo], None)
    check_streamed_names(plan, entries, start=lo)
    if len(entries) != hi - lo:
        i = lo + min(len(entries), hi - lo)
        raise StreamPlanMismatch(i, plan.names[i] if len(entries) < hi - lo else f"<buffer {k} ends at index {hi}>",
                                 "<buffer ends>" if len(entries) < hi - lo else _entry_name(entries[i - lo]),
                                 what="buffer cut")


def _entry_name(e: Any) -> str:
    return e if isinstance(e, str) else next(iter(e))


def _send_entries(entries: list[tuple[str, str, list[int]]], group: Any, src: int,
                  device: torch.device | str | None) -> None:
    dist.broadcast_object_list([list(entries)], src=src, group=group, device=_obj_device(device))


def _recv_entries(group: Any, src: int, device: torch.device | str | None) -> list[Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=src, group=group, device=_obj_device(device))
    return list(box[0] or [])


def _obj_device(device: torch.device | str | None) -> torch.device | None:
    d = torch.device(device) if device is not None else None
    return d if d is not None and d.type == "cuda" else None
