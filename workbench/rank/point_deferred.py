"""A point whose rows are finished off the job's thread: launched at the point, read once its kernel is done.

Why: a point on the job's thread waited for its kernel's copy back (a sync with all the work the job had queued),
then built ~150 rows and their annotations while the GPU sat idle: 5.2 ms of a 76 ms step on an H200 host
(``benchmarks/point_cost.py``). Here the job's thread checks the plans, reads what must be read while the objects
are as the point found them, launches, and hands the rest to the capture's writer thread; the job's next step
queues behind the probe's kernel, never behind the host.

What is read at the launch, on the job's thread: each plan's fit (``probe.fit_and_launch``), the tensors' tracking
entries (``poison.written_from``), the agreement columns (``agree.columns``: collectives and declarations as of the
point), host copies of the tensors with a computable value too large for the kernel to keep whole (``reference``),
the outputs' annotation. What waits for the kernel: the statistics, and every column computed from them. The rows
are those the job's thread would have made, byte for byte (``tests/test_point_deferred.py``).

Taken only where every object is a module whose cached plan fits and every output is one fusable tensor on the
same device, with no host reads in force (``probe._HOST_READ``); ``launch`` returns None otherwise and the point
runs whole on the job's thread, as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from workbench.rank import agree, poison, probe, reference, remote
from workbench.rank import probe_fused as _pf


class Deferred:
    """A launched point: ``rows()`` waits for its kernels and makes its tensor and output rows (any thread)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.modules: list[tuple[Any, Any]] = []  # (plan entry, launch slot)
        self.facts: list[tuple[int, bool, tuple | None, bool]] = []  # per row: numel, poisonable, tracked, sharded
        self.cols: dict[str, dict[str, str]] = {}  # agree's columns per row name
        self.refs: dict[str, tuple[Any, torch.Tensor]] = {}  # name -> (host copy or dtype, expected value)
        self.copied: list[tuple[Any, torch.device]] = []  # per GPU copied from: an event after its host copies
        self.outputs: tuple[Any, Any, list[dict[str, Any]], list[dict[str, Any]]] | None = None
        self.count = 0

    def rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows: list[dict[str, Any]] = []
        for entry, slot in self.modules:
            rows += probe._rows(entry, self.rank, slot)
        for row, (numel, poisonable, tracked, sharded) in zip(rows, self.facts):
            row["written"] = poison.written_from(numel, poisonable, row.get("poisoned"), row.get("fingerprint"),
                                                 tracked)
            row["sharded"] = sharded
        for row in rows:
            row.update(self.cols[row["name"]])
        for event, dev in self.copied:
            _pf.wait(event, dev)
        for row in rows:
            ref = self.refs.get(row["name"])
            row["ref_diff"] = None if ref is None else reference.diff_of(_value(ref[0], row), ref[1])
        outputs: list[dict[str, Any]] = []
        if self.outputs is not None:
            plan, slot, outputs, annotations = self.outputs
            probe.fill(outputs, plan.columns(None, slot))
            for row, more in zip(outputs, annotations):
                row.update(more)
        return rows, outputs


def launch(objects: Mapping[str, Any], ctx: Any, rank: int) -> Deferred | None:
    """Launch the point's probe of ``objects`` and ``ctx.outputs`` and read what cannot wait; None where the point
    must run whole on the job's thread (see the module docstring)."""
    if probe._HOST_READ or not objects or not all(isinstance(o, nn.Module) for o in objects.values()):
        return None
    outs = _outputs(ctx, rank)
    if outs is None:
        return None
    point = Deferred(rank)
    for key, obj in objects.items():
        fit = probe.fit_and_launch(obj, f"{key}.")
        if fit is None:
            return None  # what was launched is read by no one: the point runs on the job's thread
        point.modules.append(fit)
    whole: dict[str, Any] = {}
    for key, (entry, _) in zip(objects, point.modules):
        held = list(map(weakref.ref.__call__, entry.whole))
        whole.update(zip(entry.names, held))
        point.facts += _facts(key, entry, held, ctx.rank_local)
    every = {**objects, **ctx.user_objects()}
    stamp = probe.plan_stamp(every)
    names = list(whole)
    point.cols = agree.columns(names, whole, every, ctx.rank_local, stamp)
    devices = set()
    for name, exp in reference.expectations(dict(objects), ctx.expected, stamp).items():
        t = whole.get(name)
        t = probe._local(t) if t is not None else None
        if t is None or t.is_meta or t.numel() != exp.numel():
            continue
        if ctx.expected.get(name) is exp:  # the job's own tensor (``expect``): as it is now, not when the writer reads
            devices.add(exp.device)
            exp = _host_copy(exp)
        if t.numel() * t.element_size() <= _pf.RAW_SMALL:  # the kernel keeps its bytes whole: read from its row
            point.refs[name] = (t.dtype, exp)
        else:
            point.refs[name] = (_host_copy(t), exp)
            devices.add(t.device)
    for dev in devices - {torch.device("cpu")}:  # each copy from a GPU is queued on its own device's stream
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
        point.copied.append((event, dev))
    point.count = len(names)
    if outs:
        plan, rows, annotations = outs
        point.outputs = (plan, plan.launch(), rows, annotations)
        point.count += len(rows)
    return point


def _facts(key: str, entry: Any, held: list, rank_local: set[str]) -> list[tuple[int, bool, tuple | None, bool]]:
    """Per row of ``entry``'s plan, what ``written_from`` and ``sharded`` read of its tensor at the point: the
    static part once per plan, the tracking entries at each point (``to_empty`` may have tracked them since)."""
    static = _STATIC.get(entry.serial)
    if static is None:
        local = [probe._local(t) for t in held]
        static = _STATIC[entry.serial] = (
            [(t.numel(), t.dtype in poison.POISON_BITS) for t in local], [t.data_ptr() for t in local],
            [type(t).__name__ == "DTensor" for t in held])
        if len(_STATIC) > 16:
            del _STATIC[next(iter(_STATIC))]
    sizes, ptrs, dtensor = static
    mine = key.split(".", 1)[0] in rank_local  # as the job's thread reads a row's name: its first part
    return [(n, p, e, d or mine) for (n, p), e, d in zip(sizes, poison.tracked(ptrs), dtensor)]


_STATIC: dict[int, tuple] = {}  # plan serial -> ``_facts``' static part (a plan that fits: its tensors, in place)


def _outputs(ctx: Any, rank: int) -> tuple | None:
    """The outputs' plan, fixed rows and annotations: () where there are none, None where one is not one plain
    fusable tensor on the device the others are on (the general path knows the rest)."""
    outputs = ctx.outputs
    if not outputs:
        return ()
    tensors = list(outputs.values())
    if not all(type(t) is torch.Tensor and _pf.fusable(t) and t.numel() for t in tensors):
        return None
    if len({t.device for t in tensors}) > 1:
        return None
    rows = [probe._fixed_row(rank, name, "output", t) for name, t in outputs.items()]
    skeleton = [{"name": name} for name in outputs]
    remote.annotate_outputs(skeleton, ctx)  # what the job's thread adds to an output's row, read at the point
    return _pf.plan_for(tensors), rows, [{k: v for k, v in s.items() if k != "name"} for s in skeleton]


def _value(held: Any, row: dict[str, Any]) -> torch.Tensor:
    """A tensor with a computable value as the point read it: its host copy, or (a dtype) its bytes as the kernel
    kept them whole in the row's ``raw`` (hex, memory order)."""
    if isinstance(held, torch.Tensor):
        return held
    return torch.frombuffer(bytearray.fromhex(row["raw"]), dtype=held)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the host, queued on its device's current stream (read only after a later event there);
    a CPU tensor's copy at once."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    out.copy_(t.detach(), non_blocking=t.is_cuda)
    return out
