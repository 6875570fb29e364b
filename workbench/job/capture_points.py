"""What a capture's point records and writes: the ``Points`` part of ``shard.Capture``.

A point probes the objects it is given with what the job told the capture since the last one (outputs,
expectations, notes, a forward trace), appends its line to ``points.jsonl`` and rewrites the manifest (at most
once a second: ``MANIFEST_EVERY_S``); on a GPU
job the line is written by the writer thread (``writer.py``) while the device works, ``flush`` waiting for it.
Flight Recorder's record is read on the way (``FR_READ_EVERY``). Its own module so that ``Capture`` (``shard.py``:
install, close, the guest's rule) stays small enough to read whole; the attributes it reads are the ones
``Capture.__init__`` sets, and a fault is ``Capture._fault``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
import weakref
from typing import Any

from workbench.job import debug_server, keys, writer
from workbench.job.api import takes as _takes
from workbench.rank import shard_format

# A GPU job's capture reads Flight Recorder every this many points (or sooner, before its ring could wrap): reading
# the whole ring took 4 ms a point on 2 x H200 (torch 2.11, ~50 calls a step, a 2000-entry ring), the dearest part
# of a point; each call is still named by the point it led to (``ledger_fr.Complement.mark``).
FR_READ_EVERY = 8
# A point rewrites the manifest at most this often (the first point's always): each rewrite is the whole document,
# every point's name in it, ~0.7 ms a point on an H200 host at 20 points and growing with every point of a job left
# on. The points file is what was recorded (the reader's and ``shard_format.last_point``'s); the close, a fault and
# an attach rewrite it at once.
MANIFEST_EVERY_S = 1.0


def store_job() -> str | None:
    """An id every rank of this process group reads the same: the first rank to ask writes it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        got = store.compare_set(keys.JOB, "", f"job-{uuid.uuid4().hex[:12]}")
        return got.decode() if isinstance(got, bytes) else str(got)
    except (RuntimeError, ValueError, AttributeError):  # no store (a group of torch's own making), or it is down
        return None


def warm_index(started: bool, current: int, local_rank: int, count: int) -> int:
    """The GPU a rank's warm-up loads the probe's kernel on. A job's first CUDA call is most often
    ``torch.cuda.set_device(local_rank)``, and CUDA starts inside it, before that device is current: the current
    device read there is 0. The warm-up then made a context on GPU 0 from every rank and loaded the kernel for
    ``cuda:0`` only (rank 1 of two held 518 MiB of GPU 0 under ``workbench job``, none plain;
    ``scripts/gpu_warm_device.sh``). So inside CUDA's start: the launcher's local rank, modulo the GPUs seen (one, where
    each rank sees only its own); where CUDA had started before the capture (``started``): the current device, the
    job's own choice."""
    if started or count <= 0:
        return current
    return local_rank % count


class Points:
    """``point`` and what goes with the next point (``output``, ``expect``, ``local``, ``note``, ``trace``), the
    writer that finishes a GPU job's points (``flush``) and the manifest the points rewrite."""

    _world_pg: Any = None  # the job's world process group, held from the first point to the close (``_where``)
    _manifest_at = float("-inf")  # when a point last rewrote the manifest (``MANIFEST_EVERY_S``)

    @_takes()
    def output(self, name: str, tensor: Any, **extra: Any) -> None:
        """An output for the next point (logits, a loss), with scalar extras (``ref_max_abs_diff=...``)."""
        if self._usable():
            self.ctx.output(name, tensor, **extra)

    @_takes()
    def expect(self, name: str, value: Any) -> None:
        """What tensor ``name`` (as probed, e.g. ``model.model.rotary_emb.inv_freq``) should hold."""
        if self._usable():
            self.ctx.expect(name, value)

    @_takes()
    def local(self, *keys: str) -> None:
        """Objects (by the point's keyword) that are this rank's own, never compared with rank 0's."""
        if self._usable():
            self.ctx.local(*keys)

    @_takes()
    def note(self, message: str) -> None:
        """A line for the next point: what this rank did that the tables cannot show."""
        if self._usable():
            self.ctx.note(message)

    @_takes(contextlib.nullcontext)
    def trace(self, model: Any, *, run: str = "model") -> Any:
        """Trace one forward of ``model`` (a row per module call); the rows go with the next point."""
        from workbench.rank.trace import trace_forward

        if not self._usable():
            return contextlib.nullcontext()
        try:
            return trace_forward(self.ctx, model, run=run)
        except Exception as exc:  # the boundary of cap.trace: one line, the job's forward runs untraced
            if self.strict:
                raise
            self._fault("at trace", exc)
            return contextlib.nullcontext()

    @_takes()
    def point(self, name: str, *, same_on: Any = "learned", **objects: Any) -> dict[str, Any] | None:
        """Probe ``objects`` on this rank now and append them to the shard as point ``name``.

        Objects go by keyword only (``cap.point("step1", model=model)``): a call with one by position
        (``cap.point("x", model)``) is said once on stderr and records nothing (``_takes``).

        Modules and dicts of tensors are probed tensor by tensor (the ``tensors`` table); a bare
        tensor is an output (``logits=out``), as ``output(name, t)`` records it. ``same_on``: the ranks the
        bare tensors must agree across (``"world"``, a group, ranks; None: each rank's own; a dict per
        output name); left out, learned (``rank/agree.py``). Returns the point's size: rows, bytes written,
        seconds spent; None where the capture is closed or a fault stopped it (a fault here is one line on
        stderr: ``guest.py``).
        """
        if not self._usable():
            return None
        self._gc.hold()  # released on return, or once written where the rows were made here (``_handed``)
        handed = False
        try:
            info = self._point(name, same_on, objects)
            handed = info.pop("_handed", False)
            return info
        except Exception as exc:  # the boundary of cap.point: one line, the capture off, the job goes on
            if self.strict:
                raise
            self._fault(f"at point `{name}`", exc)
            return None
        finally:
            if not handed:
                self._gc.release()

    def _point(self, name: str, same_on: Any, objects: dict[str, Any]) -> dict[str, Any]:
        import torch

        from workbench.rank import point_deferred, probe, remote, trace

        t0 = time.perf_counter()
        now = time.time()
        if self.job is None:
            self.job = store_job() or f"local-{shard_format.host()}-{os.getppid()}"
            if self._ledger is not None:
                self._ledger.session = self.job
        if not self.points and torch.cuda.is_available() and torch.cuda.is_initialized():
            from workbench.rank import probe_fused

            probe_fused.warm_async(plain_meanwhile=True)  # the kernel builds aside (~1 s); meanwhile the plain path
        self._where()
        self._choose_writer()
        when = f"before point `{name}`"
        read_fr = False  # the calls on the way here: read now, or by the writer once the point is handed over
        if self._fr is not None and self._ledger is not None:
            self._fr.mark(str(self._ledger.step))
            if self._writer is None:
                self.fill_from_flight_recorder(when)
            else:
                read_fr = self._fr.due(FR_READ_EVERY)
        objects = dict(objects)
        for key, value in list(objects.items()):
            if isinstance(value, torch.Tensor):
                spec = same_on.get(key, "learned") if isinstance(same_on, dict) else same_on
                self.ctx.output(key, value, same_on=spec)
                del objects[key]
        self._remember(objects)
        with self._poison.poisoned(False):  # the probe's own scratch is not the job's memory
            deferred = point_deferred.launch(objects, self.ctx, self.rank) if self._writer is not None else None
            if deferred is None:
                held: dict[str, list] = {}
                rows = probe.probe_objects(objects, self.rank, held)
                remote._annotate(rows, objects, self.ctx, held)
                outputs = probe.probe_dict(self.ctx.outputs, self.rank, kind="output")
        if deferred is None:
            remote.annotate_outputs(outputs, self.ctx)
            count = len(rows) + len(outputs)
        else:  # the rows are made on the writer, once the kernel is done (``_finish_handed``)
            rows, outputs, count = None, None, deferred.count
        record = {"kind": "point", "point": name, "index": len(self.points), "t": now,
                  "elapsed": now - self._t_last, "probe_s": time.perf_counter() - t0, "tensors": rows,
                  "outputs": outputs, "trace": trace.take(self.ctx), "notes": self.ctx.notes[:]}
        self.ctx.outputs.clear()
        self.ctx.output_extras.clear()
        self.ctx.notes.clear()
        self.points.append(name)
        if deferred is None:  # a deferred point is the latest once its rows are made (``_finish_handed``)
            self._latest, self._latest_at = record, record["index"]
        if self._ledger is not None:
            self._ledger.step = str(len(self.points))  # what follows is on the way to the next point
        info = {"point": name, "rows": count, "bytes": None, "seconds": 0.0}
        points = list(self.points)
        if self._writer is None:
            self._finish_point(record, info, points)
        else:  # bytes filled in once written (``flush``)
            self._writer.submit(f"at point `{name}`", lambda: self._finish_handed(record, info, points, deferred),
                                point=True, lag=deferred is not None)
            info["_handed"] = deferred is None  # rows made here live until written: collection held until then
            if read_fr:  # after the point's own work: the writer reads while the job launches its next step
                self._writer.submit(f"reading Flight Recorder {when}",
                                    lambda: self.fill_from_flight_recorder(when, marked_only=True))
        self._t_last = time.time()
        info["seconds"] = time.perf_counter() - t0
        return info

    def _finish_handed(self, record: dict[str, Any], info: dict[str, Any], points: list[str],
                       deferred: Any = None) -> None:
        if deferred is not None:  # its rows are made here: collection held while they live (``point`` let go)
            self._gc.hold()
        try:
            if deferred is not None and self.stopped is None:
                record["tensors"], record["outputs"] = deferred.rows()
                if record["index"] > self._latest_at:  # until then the latest is the point before, with its rows
                    self._latest, self._latest_at = record, record["index"]
            self._finish_point(record, info, points)
        finally:
            self._gc.release()

    def _finish_point(self, record: dict[str, Any], info: dict[str, Any], points: list[str]) -> None:
        """The point's line and the manifest (on a GPU job, on the writer thread)."""
        if self.stopped is not None:
            return  # a fault stopped the capture meanwhile: what it kept is what it said
        line = json.dumps(record, default=shard_format.plain) + "\n"
        self._points_file.write(line)
        self._points_file.flush()
        self._written = points
        if self._latest is record:  # not a later point's, handed over meanwhile
            self._latest = line
        info["bytes"] = len(line)
        if self._ledger is not None:
            self._settle()
        now = time.monotonic()
        if now - self._manifest_at >= MANIFEST_EVERY_S:
            self._manifest_at = now
            self._write_manifest(points)

    def _warm_when_cuda_starts(self) -> None:
        """The probe's kernel starts building when the job initialises CUDA (``torch.cuda._lazy_call``: at once where
        it has), not at the first point: a job's first point on real tensors comes right after ``to_empty``, and it
        took the plain path while NVRTC built (384-598 ms on an H200, over the 0.5 s goal). Points meanwhile take the
        plain path as before (``plain_meanwhile``). A capture closed or stopped by then starts nothing. NVRTC's
        compile needs no CUDA context: it starts now, as the capture opens (``precompile_async``), and the init's
        warm-up only loads what it made (at cc51d85 the build from the init, 0.58 s fresh, still ran at the
        ``to_empty`` point: 529 ms; at 4d040dd the load took 0.11 s and that point 11.0 ms)."""
        import torch

        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if lazy_call is None or not torch.cuda.is_available():
            return
        with contextlib.suppress(Exception):  # the compile alone, now (no CUDA context); the init then loads it
            from workbench.rank import probe_fused

            probe_fused.precompile_async()
        this = weakref.ref(self)
        started = torch.cuda.is_initialized()  # then ``start`` runs at once, on the device the job chose

        def start() -> None:
            # A boundary inside the job's own CUDA initialisation, where a raise would fail its ``_lazy_init``
            # (torch's DeferredCudaCallError): whatever goes wrong here, the first point starts the build instead.
            with contextlib.suppress(Exception):
                cap = this()
                if cap is not None and not cap._closed and cap.stopped is None:
                    from workbench.job.launcher import launcher_env
                    from workbench.rank import probe_fused

                    index = warm_index(started, torch.cuda.current_device(), launcher_env()["local_rank"],
                                       torch.cuda.device_count())
                    probe_fused.warm_async(torch.device("cuda", index), plain_meanwhile=True)

        lazy_call(start)

    def _choose_writer(self) -> None:
        """Once, at the first point (the device is known by then): the writer thread on a GPU job."""
        if self._writer_chosen:
            return
        self._writer_chosen = True
        if writer.wanted(self.ctx.device.type == "cuda", self.strict):
            self._writer = writer.Writer(lambda where, exc: self._fault(where, exc, now=False))
            self._stack.callback(self._writer.stop)

    @_takes(True)
    def flush(self, timeout: float = writer.DRAIN_S) -> bool:
        """Wait until every point handed to the writer is on disk (a GPU job's points are written aside); True
        when nothing is left. Close, a breakpoint, the job's exception and the debug server do it themselves."""
        return self._writer is None or self._writer.drain(timeout)

    # -- the shard's own state: the last point's objects, where the rank runs, the manifest ---------
    def _remember(self, objects: dict[str, Any]) -> None:
        self._objects_weak = self.watch is None
        if not self._objects_weak:
            self._objects = dict(objects)
            return
        refs = {}
        for key, obj in objects.items():
            with contextlib.suppress(TypeError):
                refs[key] = weakref.ref(obj)
        self._objects = refs

    def _where(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.doc["backend"] = dist.get_backend()
            self.ctx.backend = self.doc["backend"]
            if self._world_pg is None:
                # Held until the capture closes, so that the world group's last reference never drops inside the
                # job's own teardown: torch's ``~ProcessGroupGloo`` joins its worker threads with the GIL held,
                # while a worker may be dropping a finished backward's work, whose thread-local state holds a Python
                # object (``_engine_run_backward`` stashes a context), so it waits for the GIL: a deadlock at a
                # DDP job's exit, 7 of 24 zero-code accelerate jobs on a loaded 2-core box (gdb). At close the
                # workers are idle and the join is immediate.
                self._world_pg = dist.group.WORLD
                self._stack.callback(setattr, self, "_world_pg", None)  # back to torch's own lifetime at the unwind
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            dev = torch.device("cuda", torch.cuda.current_device())
            if dev != self.ctx.device:  # the device's name once (a driver query: ~0.1 ms of every point on an H200)
                self.ctx.device = dev
                self.doc["device"] = f"{dev} {torch.cuda.get_device_name(dev)}"

    def _write_manifest(self, points: list[str] | None = None) -> None:
        self.doc.update(job=self.job, points=list(self.points) if points is None else points, updated_at=time.time())
        url = debug_server.worker_url()
        if url is not None:  # the job runs PyTorch's debug server: where this rank's worker answers
            self.doc["debug_server"] = url
        shard_format.write_json_atomic(self.dir / shard_format.MANIFEST, self.doc)

    def _settle(self) -> None:
        """The ends of the calls whose device work finished by now (the probe's copies waited for the stream)."""
        from workbench.rank import ledger as ledger_mod

        ledger_mod.settle()  # raises nothing of its own: a work's query and a call's end each say their fault

    def _kept(self) -> str:
        n = len(self._written)
        return f"{self.dir} keeps {n} point(s)" + (f" up to `{self._written[-1]}`" if n else "")
