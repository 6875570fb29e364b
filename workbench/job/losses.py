"""The first non-finite loss: the tensor ``backward()`` runs from, watched without a device sync per step.

Every stack computes a loss and runs ``backward()`` from it (DeepSpeed's ``engine.backward`` and Lightning's
``fabric.backward`` included: they end in ``torch.autograd.backward``, which ``Tensor.backward`` calls too). The
watch wraps ``torch.autograd.backward``: before each call it queues ``isfinite(loss).all()`` on the loss's device
and, on a GPU, a non-blocking copy of that flag into pinned memory with an event behind it; the flag is read once
the event says it landed (at the next backward or step, never waiting). On a CPU it is read at once.

The first loss found non-finite goes with the next point every rank takes (the loss as an output, a note saying
which backward, after which optimizer step, and whether the stack then ran another backward without stepping, as
DeepSpeed does on overflow). It never takes a point of its own: a point one rank takes and the others do not
shifts that rank's later points and ledger steps against theirs (tried: DeepSpeed's job then read "rank 1 never
issued call #99 that rank 0 issued in step `nonfinite_loss`", a false parting). After the first one the watch
passes every call straight through. The loss's value and the call's arguments are the job's own; a fault of the
watch is a line in the shard's ``hook_errors``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MARK = "__workbench_losses__"


class Losses:
    """The watch over ``torch.autograd.backward`` of one capture: ``due()`` hands the next point what it found."""

    def __init__(self, errors: Callable[[BaseException, Any], None]) -> None:
        self.errors = errors
        self.backwards = 0  # backward calls seen
        self.steps = 0  # optimizer steps seen
        self.pending: tuple[Any, ...] | None = None  # (flag, host copy, event, loss, backward, steps then)
        self.bad: dict[str, Any] | None = None  # the first non-finite loss, until a point took it
        self.done = False

    def install(self) -> Callable[[], None]:
        import torch.autograd

        original = torch.autograd.backward
        if getattr(original, _MARK, False):
            return lambda: None
        watch = self

        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if not watch.done:
                watch._guard(watch._before_backward, tensors)
            return original(tensors, *args, **kwargs)

        setattr(backward, _MARK, True)
        torch.autograd.backward = backward

        def undo() -> None:
            if torch.autograd.backward is backward:
                torch.autograd.backward = original

        return undo

    def _guard(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self.done = True  # a watch that failed once steps aside
            self.errors(exc, "loss watch")
            return None

    # -- the calls ----------------------------------------------------------------------------------------
    def _before_backward(self, tensors: Any) -> None:
        import torch

        self._resolve()
        if self.bad is not None and self.bad["steps"] == self.steps:  # no optimizer step since: it was skipped
            self.bad["skipped"] = True
        loss = tensors if isinstance(tensors, torch.Tensor) else next(iter(tensors), None)
        self.backwards += 1
        if self.bad is not None or not isinstance(loss, torch.Tensor) or not loss.is_floating_point() or \
                loss.is_meta:
            return
        loss = loss.detach()
        flag = torch.isfinite(loss).all()
        if loss.device.type not in ("cuda", "cpu"):  # reading it would wait for that device: not watched
            return
        if loss.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending = (flag, host, event, loss, self.backwards, self.steps)
        else:
            self.pending = (flag, flag, None, loss, self.backwards, self.steps)
            self._resolve()

    def stepped(self) -> None:
        """An optimizer step ran (the step hook's call)."""
        self.steps += 1

    def _resolve(self) -> None:
        """Read the pending flag when it is there (never waiting for the device)."""
        if self.pending is None:
            return
        _flag, host, event, loss, n, steps = self.pending  # the flag itself held until its copy landed
        if event is not None and not event.query():
            return
        self.pending = None
        if self.bad is None and not bool(host):
            import torch

            kind = "nan" if bool(torch.isnan(loss).any()) else "inf"
            self.bad = {"loss": loss, "kind": kind, "backward": n, "steps": steps, "skipped": False}

    def due(self) -> tuple[dict[str, Any], str] | None:
        """(the outputs, the note) for the point being taken, once, when a loss was found non-finite; else None."""
        if self.done:
            return None
        self._resolve()
        bad = self.bad
        if bad is None:
            return None
        self.bad, self.done, self.pending = None, True, None
        note = (f"nonfinite loss: backward() {bad['backward']} ran from a loss that was {bad['kind']}, after "
                f"optimizer step {bad['steps']}" + ("; the stack then ran another backward without an optimizer "
                                                    "step (a step skipped for overflow)" if bad["skipped"] else ""))
        return {"loss": bad["loss"]}, note
