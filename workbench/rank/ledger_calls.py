"""The collectives ledger around the job's collective calls only, not around every op.

``ledger.recording`` keeps a ``TorchDispatchMode`` on for a whole step: every aten op then passes a
Python check, and while any Python dispatch mode is on ``torch.compile`` runs the model eagerly
(measured on CPU: a compiled module's first call 0.02 s instead of compiling). A training job
wants neither. ``CallLedger`` instead wraps the collective functions of ``torch.distributed``
(``all_reduce``, ``all_gather_single`` (FSDP2's), ``reduce_scatter_single``, ``broadcast``,
``_broadcast_coalesced`` (FSDP1's ``sync_module_states``), the object and point-to-point calls, the exit of
``_coalescing_manager``, ...)
and turns the same recorder on for the length of each call: the rows are the dispatch mode's own
(op, dtypes, shapes, traffic, the user's line, per-dtype buckets of ``_broadcast_coalesced``), a
call's start line is on disk before it runs, an async call ends when its work does.

Not seen this way: collectives that never pass a Python function of ``torch.distributed`` (functional
collectives of DTensor; DDP's C++: measured on a 2-rank CPU job, the full mode saw at wrap an
all_gather (the parameter-shape check) and 2 broadcasts, and in 2 training steps 2 reducer
all-reduces and 2 bucket-index broadcasts; this mode saw 1 broadcast at wrap and nothing in
training, so a DDP job hung in its backward is not named here), and functions a library bound by
name before ``install`` (``from torch.distributed import all_reduce``). The full mode sees those on
the thread that issues them. A job's capture completes this ledger with Flight Recorder's record
(``ledger_fr.py``): the calls here are numbered by the backend's own count, the same numbers Flight
Recorder gives, so what it recorded and this did not (DDP's reducer) are the gaps, filled from its entries.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from workbench.rank import ledger as _ledger
from workbench.rank import patch

FAMILIES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "gather", "scatter", "reduce",
            "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
            "_broadcast_coalesced")
_MARK = "__workbench_call_ledger__"
COALESCING = ("_coalescing_manager",)  # a block whose calls go out as one at its exit
# The calls a training step issues by the dozen (FSDP2's all-gathers and reduce-scatters, a gradient all-reduce),
# by name -> where the group sits among their positional arguments. Where Flight Recorder records the group (an
# NCCL group made with its buffer on: the capture turns it on before the job's first group), they pass straight
# through: recording one here costs ~1.5 ms of a step (the dispatch mode boxes the call into Python; measured on
# 2 x H200, the Llama-3.2-1B shape: 50 calls a step, 211 -> 290 ms), and Flight Recorder's own entry (op, sizes,
# dtypes, state, Python frames) becomes its row at the next point, at a hang's read, at the job's exception or at
# close (``ledger_fr.Complement``), under the same number. A broadcast (its root), point-to-point and object calls,
# gloo's calls (no completion in the record) and every call of a group Flight Recorder does not record are still
# recorded here, as they start.
FR_OPS = {"all_gather_into_tensor": 2, "all_gather_single": 2, "reduce_scatter_tensor": 3,
          "reduce_scatter_single": 3, "all_reduce": 2}
# This file's wrapper sits between the caller and torch.distributed: plumbing, like the modes it stands in for.
_ledger._PLUMBING += (os.path.abspath(__file__),)


def collective_names(module: Any = dist) -> list[str]:
    """The collective functions ``module`` offers (its names vary by torch version: FSDP2's
    ``all_gather_single`` is recent), by family prefix; classes (``ReduceOp``) excluded."""
    out = []
    for name in dir(module):
        f = getattr(module, name, None)
        if name.startswith(FAMILIES) and callable(f) and not isinstance(f, type):
            out.append(name)
    return out


def _works(out: Any) -> bool:
    """Whether a collective function returned works its caller waits on (``async_op=True``, ``batch_isend_irecv``)."""
    items = out if isinstance(out, (list, tuple)) else [out]
    return any(isinstance(w, (dist.Work, torch._C.Future)) for w in items)


class CallLedger:
    """Record into ``book`` every collective the job calls through ``torch.distributed``'s functions."""

    def __init__(self, book: _ledger.Ledger):
        self.book = book
        self.recorder = _ledger._Recorder(book)
        self.recorder.backend_seq = True  # numbered as Flight Recorder numbers them: its entries fill the gaps
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self.flight_recorder = False  # set where Flight Recorder records the groups made from now on (NCCL's)
        self._recorded: dict[Any, bool] = {}  # group (None: the default) -> Flight Recorder records its CUDA calls
        self.passed = 0  # calls passed to Flight Recorder's record

    def install(self) -> CallLedger:
        _ledger.prepare()  # before any stack patches torch (DeepSpeed's ``zero.Init``): ``ledger.prepare`` says why
        # One wrapper per function, whichever module names it: torch compares them by identity (``P2POp`` takes
        # only ``isend``/``irecv`` as ``distributed_c10d`` names them, ``batch_isend_irecv`` tells a send by
        # ``op.op is isend``), so ``dist.isend`` and ``distributed_c10d.isend`` stay one object.
        wrapped: dict[int, Any] = {}
        for module in (dist, dist.distributed_c10d):
            for name in [*collective_names(module), *COALESCING]:
                original = getattr(module, name, None)
                if original is None or getattr(original, _MARK, False):
                    continue
                if id(original) not in wrapped:
                    wrapped[id(original)] = self._wrap_coalescing(original) if name in COALESCING \
                        else self._wrap(original)
                setattr(module, name, wrapped[id(original)])
                self._patched.append((module, name, original))
        _ledger._ACTIVE.append(self.recorder)  # _broadcast_coalesced's per-bucket context reads it
        return self

    def _wrap(self, original: Any) -> Any:
        inner = (_ledger._coalesced_wrapper(original) if getattr(original, "__name__", "") == "_broadcast_coalesced"
                 else original)

        at = FR_OPS.get(getattr(original, "__name__", ""))

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):  # an object collective's own calls: recorded already
                return inner(*args, **kwargs)
            if at is not None and self.flight_recorder and self._in_record(args, kwargs, at):
                self.passed += 1
                return inner(*args, **kwargs)
            self._local.inside = True
            try:
                with self.recorder:
                    out = inner(*args, **kwargs)
                if not _works(out):  # it returned no work to wait on: it waited on its own works
                    self.recorder.went_on()
                return out
            finally:
                self._local.inside = False

        setattr(call, _MARK, True)
        return patch.unseen(call)

    def _wrap_coalescing(self, original: Any) -> Any:
        """``_coalescing_manager``: the calls in its block only queue (gloo); its exit issues them as one coalesced
        call (``allreduce_coalesced``), outside every function wrapped here. Recorded there."""

        @functools.wraps(original)
        @contextlib.contextmanager
        def manager(*args: Any, **kwargs: Any) -> Iterator[Any]:
            block = original(*args, **kwargs)
            cm = block.__enter__()
            try:
                yield cm
            except BaseException:  # the block's own exception, whatever it is, handed to its exit as ``with`` does
                if not block.__exit__(*sys.exc_info()):
                    raise
                return
            if getattr(self._local, "inside", False):  # batch_isend_irecv's own: recorded already
                block.__exit__(None, None, None)
                return
            self._local.inside = True
            try:
                with self.recorder:
                    block.__exit__(None, None, None)
                if not kwargs.get("async_ops", args[2] if len(args) > 2 else False):
                    self.recorder.went_on()
            finally:
                self._local.inside = False

        setattr(manager, _MARK, True)
        return manager

    def _in_record(self, args: tuple, kwargs: dict, at: int) -> bool:
        """Whether Flight Recorder records this call: a CUDA tensor on an NCCL group (its group's answer kept)."""
        try:
            # FSDP2 passes its reduce-scatter's arguments by keyword
            first = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if not (isinstance(first, torch.Tensor) and first.is_cuda):
                return False
            group = kwargs.get("group", args[at] if len(args) > at else None)
            hit = self._recorded.get(group)
            if hit is None:
                pg = group if group is not None else dist.distributed_c10d._get_default_group()
                hit = self._recorded[group] = "nccl" in str(dist.get_backend(pg)).lower()
            return hit
        except Exception:  # a boundary on the job's thread, before its call: a group we cannot ask is recorded here
            return False

    def uninstall(self) -> None:
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        if self.recorder in _ledger._ACTIVE:
            _ledger._ACTIVE.remove(self.recorder)
        self.recorder.finish()
