"""Entry points the client calls on every engine; each returns plain data.

A step's exception is caught here and returned as data, so the client gets every rank's
outcome and the probe still runs on the state the failure left behind.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from workbench.rank import context, poison, probe


def start_session(session_id: str, fix: str | None, params: dict[str, Any], poison_on: bool) -> int:
    context.new_context(session_id, fix, params, poison_on)
    poison.set_poison(poison_on)
    return context._RANK["rank"]


def end_session(session_id: str) -> None:
    context.drop_context(session_id)
    poison.set_poison(False)


def run_step(session_id: str, fn: Callable, probe_names: list[str] | None) -> dict[str, Any]:
    """Run one step on this rank, then probe what the context holds."""
    ctx = context.get_context(session_id)
    poison.set_poison(ctx.poison)
    error = None
    ctx.notes.clear()
    t0 = time.perf_counter()
    try:
        fn(ctx)
    except BaseException as exc:
        error = {"error": type(exc).__name__, "message": str(exc)[:2000], "traceback": traceback.format_exc()[-6000:]}
    elapsed = time.perf_counter() - t0
    objects = ctx.user_objects()
    if probe_names is not None:
        objects = {k: objects[k] for k in probe_names if k in objects}
    t1 = time.perf_counter()
    tensors = probe.probe_objects(objects, ctx.rank)
    outputs = probe.probe_dict(ctx.outputs, ctx.rank, kind="output")
    for row in outputs:
        row.update(ctx.output_extras.get(row["name"], {}))
    return {
        "rank": ctx.rank, "error": error, "elapsed": elapsed, "probe_s": time.perf_counter() - t1,
        "tensors": tensors, "outputs": outputs, "notes": ctx.notes[:],
    }
