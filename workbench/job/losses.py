"""The first non-finite loss: the tensor ``backward()`` runs from, watched without a device sync per step.

Every stack computes a loss and runs ``backward()`` from it (DeepSpeed's ``engine.backward`` and Lightning's
``fabric.backward`` included: they end in ``torch.autograd.backward``, which ``Tensor.backward`` calls too). The
watch wraps ``torch.autograd.backward``: before each call it queues ``isfinite(loss).all()`` on the loss's device
and, on a GPU, a non-blocking copy of that flag into pinned memory with an event behind it; the flag is read once
the event says it landed (at the next backward or step, never waiting). On a CPU it is read at once.

The first loss found non-finite takes a point at the next backward, whatever ``--every`` says, on every rank, so
the ranks' points stay paired (they pair by position: a point one rank takes alone shifts its later points and
ledger steps against the others', and the reader then blames a collective; tried: "rank 1 never issued call #99
that rank 0 issued in step `nonfinite_loss`"). The rank that found it agrees the backward over the job's c10d store
(``compare_set`` of ``KEY``: the backward after the one it is in; the first rank to set it wins); every rank looks
for the key at each backward with ``store.check``, which never waits (one round trip to the store, no device sync),
and takes the point, named ``nonfinite_loss``, once that backward returned (or the first one after it, should it
have read the key late: no point comes between, so the positions still pair). After the backward, not before: a
stack's state has settled there (FSDP2 resharded its root, ZeRO-3 partitioned again), as at a step point, so the
point reads each tensor as the points around it do (a point before it read FSDP2's unsharded root parameters, and
the diagnosis lost the poisoned `norm.weight` of Lightning's job at `to_empty`). The point waits for no optimizer
step; it comes before the step of the backward it follows. A rank whose loss stayed finite
takes it too: DeepSpeed's overflow decision is global, so every rank skipped that step, and no torch optimizer
step (nor its step point) ever runs again in such a job. Without a process group (one process) the point is
this process's own. The loss itself goes with the first point taken after it was found (this one, or a step
point before it): the loss as this rank's output, a note saying which backward, after which optimizer step, and
whether the stack then ran another backward without stepping (a step skipped for overflow). The loss's value and
the call's arguments are the job's own; a fault of the watch is a line in the shard's ``hook_errors``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from workbench.job import keys
from workbench.rank import patch

_MARK = "__workbench_losses__"
KEY = keys.NONFINITE_LOSS  # in the job's c10d store: the backward after which every rank takes the point


class Losses:
    """The watch over ``torch.autograd.backward`` of one capture: ``take(loss)`` takes the point every rank takes
    (``loss``: the tensor this backward runs from), ``due()`` hands the next point what this rank found."""

    def __init__(self, errors: Callable[[BaseException, Any], None],
                 take: Callable[[Any], None] | None = None, key: str = KEY) -> None:
        self.errors, self.take, self.key = errors, take, key
        self.backwards = 0  # backward calls seen
        self.steps = 0  # optimizer steps seen
        self.pending: tuple[Any, ...] | None = None  # (flag, host copy, event, loss, backward, steps then)
        self.bad: dict[str, Any] | None = None  # the first non-finite loss, until a point took it
        self.found = False  # this rank found its first non-finite loss: no more flags
        self.agreed: int | None = None  # the backward after which every rank takes the point
        self.taken = False  # that point taken (or none will be)
        self.failed = False
        self._store: Any = None

    def install(self) -> Callable[[], None]:
        import torch.autograd

        original = torch.autograd.backward
        if getattr(original, _MARK, False):
            return lambda: None
        watch = self

        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            due = None
            if not watch.failed and not (watch.found and watch.taken):
                due = watch._guard(watch._before_backward, tensors)
            result = original(tensors, *args, **kwargs)
            if due is not None and watch.take is not None:  # after the backward: a stack's own state settled
                watch._guard(watch.take, due[0])
            return result

        setattr(backward, _MARK, True)
        return patch.replace(torch.autograd, "backward", backward, original)

    def _guard(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # the boundary inside the job's backward: said in the shard, never raised
            self.failed = True  # a watch that failed once steps aside
            self.errors(exc, "loss watch")
            return None

    # -- the calls ----------------------------------------------------------------------------------------
    def _before_backward(self, tensors: Any) -> tuple[Any] | None:
        """Watch this backward's loss; (its loss,) when the point every rank takes comes after this backward."""
        import torch

        self.backwards += 1
        self._resolve()
        if self.bad is not None and self.bad["steps"] == self.steps:  # no optimizer step since: it was skipped
            self.bad["skipped"] = True
        loss = tensors if isinstance(tensors, torch.Tensor) else next(iter(tensors), None)
        due = (loss,) if self._agree() else None
        if self.found or not isinstance(loss, torch.Tensor) or not loss.is_floating_point() or loss.is_meta:
            return due
        if loss.device.type not in ("cuda", "cpu"):  # reading it would wait for that device: not watched
            return due
        loss = loss.detach()
        flag = torch.isfinite(loss).all()
        if loss.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending = (flag, host, event, loss, self.backwards, self.steps)
        else:
            self.pending = (flag, flag, None, loss, self.backwards, self.steps)
            self._resolve()
        return due

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
        if not self.found and not bool(host):
            import torch

            kind = "nan" if bool(torch.isnan(loss).any()) else "inf"
            self.bad = {"loss": loss, "kind": kind, "backward": n, "steps": steps, "skipped": False}
            self.found = True
            self._publish()

    # -- the point every rank takes -------------------------------------------------------------------------
    def _group_store(self) -> tuple[bool, Any]:
        """(whether a process group runs, the job's c10d store or None)."""
        if self._store is not None:
            return True, self._store
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False, None
        if dist.get_world_size() < 2:
            return False, None
        self._store = dist.distributed_c10d._get_default_store()
        return True, self._store

    def _publish(self) -> None:
        """Agree the backward after this one with the other ranks (the first rank to set the key wins)."""
        if self.taken or self.agreed is not None:
            return
        want = self.backwards + 1
        group, store = self._group_store()
        if not group:
            self.agreed = want  # one process: its own
        elif store is not None:
            self.agreed = int(store.compare_set(self.key, "", str(want)))

    def _agree(self) -> bool:
        """Whether the point every rank takes comes after this backward: the agreed one (or the first after it)."""
        if self.taken:
            return False
        if self.agreed is None:
            group, store = self._group_store()
            if group and store is not None and store.check([self.key]):  # never waits for the key
                self.agreed = int(store.get(self.key))
        if self.agreed is not None and self.backwards >= self.agreed:
            self.taken = True
            return True
        return False

    def due(self) -> tuple[dict[str, Any], str] | None:
        """(the outputs, the note) for the point being taken, once, when a loss was found non-finite; else None."""
        if self.failed:
            return None
        self._resolve()
        bad = self.bad
        if bad is None:
            return None
        self.bad, self.pending = None, None
        note = (f"nonfinite loss: backward() {bad['backward']} ran from a loss that was {bad['kind']}, after "
                f"optimizer step {bad['steps']}" + ("; the stack then ran another backward without an optimizer "
                                                    "step (a step skipped for overflow)" if bad["skipped"] else ""))
        return {"loss": bad["loss"]}, note
