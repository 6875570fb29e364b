"""Entry points the client calls on every engine; each returns plain data.

A step's exception is caught here and returned as data, so the client gets every rank's
outcome and the probe still runs on the state the failure left behind. Later steps of that
session are then skipped on that rank (a "skipped" event), not run into a cascade of
AttributeErrors on what the failed step never built; an error inside torch.distributed (the
incident itself) or a ``WorkbenchError`` (a check that refused before doing damage) does not
stop the steps after it.
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from workbench.errors import WorkbenchError
from workbench.rank import agree, context, control, ledger, poison, probe, reference, trace
from workbench.rank.warmup import WARM_MODULES


def start_session(session_id: str, fix: str | None, params: dict[str, Any], poison_on: bool,
                  ledger_dir: str | None = None, attempt: int = 0) -> int:
    context.new_context(session_id, fix, params, poison_on)
    agree.forget()
    poison.reset_tracking()
    poison.set_poison(poison_on)
    ledger.open_ledger(session_id, ledger_dir, context._RANK["rank"], attempt)
    return context._RANK["rank"]


def end_session(session_id: str) -> None:
    ctx = context._SESSIONS.get(session_id)
    context.drop_context(session_id)
    if ctx is not None and ctx.workdir:
        shutil.rmtree(ctx.workdir, ignore_errors=True)  # checkpoints and scratch of this session
    ledger.close_ledger(session_id)
    poison.uninstall()


def run_step(session_id: str, fn: Callable, probe_names: list[str] | None, step: str = "") -> dict[str, Any]:
    """Run one step on this rank, then probe what the context holds."""
    ctx = context.get_context(session_id)
    poison.set_poison(ctx.poison)
    error = None
    ctx.notes.clear()
    trace.take(ctx)  # rows of an earlier step that never reached the client
    t0 = time.perf_counter()
    book = ledger.get_ledger(session_id)
    failed = getattr(ctx, "_failed_step", None)
    halted = False  # this step's error stops the later steps on this rank: the client's cursor stays here
    fed = agree.FedInputs(ctx.user_objects())  # what this step's forwards are fed: equal inputs, equal outputs
    if failed is not None:
        # The steps after a failure would only cascade (AttributeError on what it never built): say so once.
        error = {"kind": "skipped", "error": "Skipped",
                 "message": f"not run on rank {ctx.rank}: step {failed!r} failed here earlier", "traceback": ""}
    else:
        try:
            with ledger.recording(book, step) if book is not None else contextlib.nullcontext(), \
                    poison.allocations(), fed:
                control.in_step(step or getattr(fn, "__name__", "?"))  # control.interrupt may stop it
                try:
                    fn(ctx)
                finally:
                    control.in_step(None)
        except BaseException as exc:  # the step's own failure, whatever it is (an interrupt too): its reply says it
            error = {"error": type(exc).__name__, "message": str(exc)[:2000],
                     "traceback": ledger.traceback_text(exc)[-6000:]}
            if not _incident_error(exc):
                ctx._failed_step = step or getattr(fn, "__name__", "?")
                halted = True
    elapsed = time.perf_counter() - t0
    objects = ctx.user_objects()
    if probe_names is not None:
        objects = {k: objects[k] for k in probe_names if k in objects}
    t1 = time.perf_counter()
    held: dict[str, list] = {}
    tensors = probe.probe_objects(objects, ctx.rank, held)
    _annotate(tensors, objects, ctx, held)
    outputs = probe.probe_dict(ctx.outputs, ctx.rank, kind="output")
    annotate_outputs(outputs, ctx, fed.digest)
    return {
        "rank": ctx.rank, "error": error, "halted": halted, "elapsed": elapsed, "probe_s": time.perf_counter() - t1,
        "tensors": tensors, "outputs": outputs, "notes": ctx.notes[:],
        "trace": trace.take(ctx),
    }


def _incident_error(exc: BaseException) -> bool:
    """An error the later steps should still run after: a check's own refusal (``WorkbenchError``,
    raised before any damage), or one raised inside torch.distributed (a collective that timed out
    or mispaired: the incident itself, whose aftermath the next steps and probes show)."""
    if isinstance(exc, WorkbenchError):
        return True
    return any("/torch/distributed/" in f.filename.replace("\\", "/")
               for f in traceback.extract_tb(exc.__traceback__))


def _annotate(rows: list[dict[str, Any]], objects: dict[str, Any], ctx: context.RankContext,
              held: dict[str, list] | None = None) -> None:
    """Per row: ``written`` since materialisation, and ``ref_diff`` against a computable value. ``held``: the
    modules' (name, tensor) pairs the probe already walked; a module missing there is walked here."""
    by_name: dict[str, Any] = {}
    whole: dict[str, Any] = {}  # as held: a DTensor whole, for its placements
    sharded: set[str] = set()
    for key, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            pairs = (held or {}).get(key)
            if pairs is None:
                pairs = [(n, t) for n, _, t in probe.named_tensors(obj, f"{key}.")]
            for n, t in pairs:
                by_name[n] = probe._local(t)
                whole[n] = t
                if type(t).__name__ == "DTensor":
                    sharded.add(n)  # a DTensor: this rank holds a shard, not the whole tensor
        elif isinstance(obj, dict):
            whole.update({f"{key}.{k}": v for k, v in obj.items() if isinstance(v, torch.Tensor)})
        elif isinstance(obj, torch.Tensor):
            whole[key] = obj
    for row in rows:
        t = by_name.get(row["name"])
        row["written"] = None if t is None else poison.written_state(t, row.get("poisoned"), row.get("fingerprint"))
        row["sharded"] = row["name"] in sharded or row["name"].split(".", 1)[0] in ctx.rank_local
    every = {**objects, **ctx.user_objects()}
    stamp = probe.plan_stamp(every)
    agree.annotate(rows, whole, every, ctx.rank_local, stamp=stamp)
    reference.annotate(rows, by_name, reference.expectations(objects, ctx.expected, stamp))


def annotate_outputs(rows: list[dict[str, Any]], ctx: context.RankContext, fed: str = "") -> None:
    """An output's rows: rank-local or not, the step's extras (a ``same_on`` declaration among them), and the
    ranks it must agree across."""
    for row in rows:
        row["sharded"] = row["name"].split(".", 1)[0] in ctx.rank_local
        row.update(ctx.output_extras.get(row["name"], {}))
    agree.annotate_outputs(rows, ctx.outputs, ctx.output_extras, ctx.rank_local, fed)


def warm(modules: tuple[str, ...] = WARM_MODULES) -> dict[str, str]:
    """Import ``modules`` now (``workbench up`` calls this), so the first attached run does not pay for
    them in its first step. Best effort: a module that fails to import is named, never raised."""
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        # any failure of a third-party import (its module-level code may raise anything) is named, never raised:
        # an older transformers without a model family: that scenario says so itself
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed
