"""The fused probe on CUDA: one kernel launch for every tensor, one copy back, rows from arrays.

The kernel is NVRTC's build of it (``_probe_nvrtc``: about a second, on the warm-up's thread, no toolchain nor
cache) or, where NVRTC cannot build, Triton's (``_probe_triton``: built in a child process into Triton's cache;
seconds on a fresh machine). Until one is loaded, a job's points take the plain torch path.

A ``Plan`` is everything about a fixed list of tensors that does not depend on their values:
the packed descriptor table on the device (pointer, 32-bit words, first program, dtype kind),
the program -> tensor map, the accumulator buffer and its pinned host twin, and the host-side
constants that turn the copied-back arrays into row values without a per-tensor Python loop.
``probe.probe_module`` keeps one plan per module and reuses it while the module's tensors keep
their addresses, shapes and dtypes, so a repeated probe costs: a zero-fill, one launch, one
device-to-host copy, and numpy over a few [T, k] arrays.

The values are those of the plain torch path (the fingerprint bit for bit) and byte for byte
those of the per-dtype fused path this replaced (``benchmarks/probe_reference.py`` keeps it;
``tests/test_probe_identity.py`` compares).
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from workbench.rank import _probe_nvrtc
from workbench.rank.columns import WINDOW, WINDOW_OFFSETS

HEAD = 8
RAW_SMALL = 256  # bytes kept whole for tensors up to this size
RAW_LARGE = 64  # bytes kept from the start of larger tensors
WORDS_PER_ITER = 2048  # words one program reads per loop iteration
ITERS = 16  # iterations per program: 128 KiB of tensor per program (best of a sweep on an H200)
NUM_WARPS = 8
MAXNREG: int | None = None  # a cap on registers per thread (Triton's maxnreg); None: the compiler's choice
KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
FUSED_DEVICES = ("cuda",)  # the tests add "cpu" and run the kernel through Triton's interpreter
_ACC = 9  # accumulator columns per tensor (see _probe_triton.probe_all_kernel)
_WORDS = 96  # words kept per tensor: 64 raw, 8 at each of the 4 window offsets
_M32 = 0xFFFFFFFF
_FLIP = np.array([_M32, 0], dtype=np.int64)
_TRITON: dict[str, Any] = {}
_KERNEL_EVENTS: list | None = None  # benchmarks set a list: (start, end) CUDA events around each launch
_WARM: dict[str, Any] = {}  # the warm-up: its thread while it runs, then what it took
_WARM_LOCK = threading.RLock()  # orders the warm-up's step from the child's build to the load with a closing capture


def fused_enabled() -> bool:
    """Whether CUDA tensors can take a fused pass: NVRTC's build of the kernel once it is loaded, else Triton's
    (env WORKBENCH_PROBE_FUSED=0 turns both off)."""
    if os.environ.get("WORKBENCH_PROBE_FUSED", "1") == "0":
        return False
    if _nvrtc_ready():
        return True
    if _WARM.get("plain_meanwhile"):
        t = _WARM.get("thread")
        if t is not None and t is not threading.current_thread():
            if t.is_alive():
                return False  # a job's point while the kernel builds: the plain path, no wait (same values)
            _WARM.pop("thread", None)
    return _triton_ok()


def _triton_ok() -> bool:
    """Whether Triton's kernel is importable (imported on the first ask)."""
    if "ok" not in _TRITON:
        try:
            from workbench.rank import _probe_triton  # imports triton: only where CUDA tensors are probed

            _TRITON.update(kernel=_probe_triton.probe_all_kernel, hint=True, ok=True)
        # any failure of a third-party import (Triton's: ImportError, a driver's RuntimeError, ...) means no fused
        # path; said in ``why``, and the plain path stays correct
        except Exception as exc:
            _TRITON.update(ok=False, why=f"{type(exc).__name__}: {exc}")
    return bool(_TRITON["ok"])


def _nvrtc_ready() -> bool:
    """Whether NVRTC's kernel is loaded for this thread's CUDA device (no wait)."""
    index = _probe_nvrtc.loaded()
    return index is not None and torch.cuda.current_device() == index


def fusable(t: torch.Tensor) -> bool:
    return (t.device.type in FUSED_DEVICES and t.dtype in KINDS and t.is_contiguous()
            and t.data_ptr() % 16 == 0 and (t.numel() * t.element_size()) % 4 == 0 and t.numel() > 0)


def raw_len(nbytes: int) -> int:
    return nbytes if nbytes <= RAW_SMALL else RAW_LARGE


def n_windows(nbytes: int) -> int:
    return sum(1 for off in WINDOW_OFFSETS if nbytes >= off + WINDOW) if nbytes > RAW_SMALL else 0


def plan_for(tensors: list[torch.Tensor]) -> Plan:
    """A plan for ``tensors``: the last one built for the same addresses, sizes and dtypes (its descriptor table,
    buffers and host constants are then exactly what a new one would hold), else a new one. A job's outputs (the
    logits) are new tensors every step, mostly at the address the caching allocator gave the last ones: a point
    every step then skips the build (~0.5 ms of a profiled point on an H200 host)."""
    key = (tensors[0].device, tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors))
    plan = _PLAN_CACHE.pop(key, None) or Plan(tensors)
    _PLAN_CACHE[key] = plan  # the newest last: the oldest goes first
    while len(_PLAN_CACHE) > 16:
        del _PLAN_CACHE[next(iter(_PLAN_CACHE))]
    return plan


_PLAN_CACHE: dict[tuple, Plan] = {}

SPLIT_BYTES = 256 << 20  # a module's tensors past this many bytes are launched in parts (``Parts``)
SPLIT_SHARES = (0.5,)  # where the parts split, as shares of the bytes counted from the largest tensor down


class Parts:
    """A module's cached plan as one launch or several, in row order once read (``parts``: each plan with the rows
    it holds). Past ``SPLIT_BYTES`` the tensors are cut by size at ``SPLIT_SHARES``: the largest, which hold the
    first share of the bytes, go in the last launch; the next, to the second share (if any), in the one before;
    the rest (most of the rows, few of the bytes) first. The host makes each part's rows while the GPU reads the
    parts launched after it (Qwen3-1.7B's shape: 279 rows while the second kernel runs, 34 after it, where all 313
    were made after one). More cuts leave fewer rows for the end but cost the host more than they save: on one H200
    host, 1.64 ms end to end cut at half the bytes, 1.72 ms at (0.2, 0.7), 1.76 ms at (0.3, 0.8), 1.91 ms in four
    launches (``benchmarks/probe_scale.py --splits``; fixtures/gpu/probe_scale_splits_1gpu.json)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        idx = list(range(len(tensors)))
        nbytes = [t.numel() * t.element_size() for t in tensors]
        total, order = sum(nbytes), [idx]
        if total > SPLIT_BYTES and len(tensors) > 1:
            cuts, held, part = [], 0, 0
            for i in sorted(idx, key=nbytes.__getitem__, reverse=True):
                while part < len(SPLIT_SHARES) and held >= SPLIT_SHARES[part] * total:
                    part += 1
                cuts.append((part, i))
                held += nbytes[i]
            parts = [sorted(i for p, i in cuts if p == k) for k in range(len(SPLIT_SHARES), -1, -1)]
            order = [rows for rows in parts if rows]
        self.parts = [(Plan([tensors[i] for i in rows]), rows) for rows in order]
        self.T = len(tensors)

    def launch(self) -> list[tuple[torch.Tensor, Any]]:
        """Every part's launch, in order: their slots (``Plan.launch``)."""
        return [plan.launch() for plan, _ in self.parts]


class Plan:
    """One launch's worth of fusable tensors on one device (see the module docstring)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        assert WINDOW == 32 and len(WINDOW_OFFSETS) == 4 and all(o % 4 == 0 for o in WINDOW_OFFSETS)
        dev = tensors[0].device
        per = WORDS_PER_ITER * ITERS
        T = len(tensors)
        nbytes = [t.numel() * t.element_size() for t in tensors]
        nblk = [(b // 4 + per - 1) // per for b in nbytes]
        firsts = np.concatenate([[0], np.cumsum(nblk)[:-1]]).tolist()
        kinds = [KINDS[t.dtype] for t in tensors]
        rows = [[t.data_ptr(), b // 4, f, k] for t, b, f, k in zip(tensors, nbytes, firsts, kinds)]
        self.device, self.T, self.programs = dev, T, int(sum(nblk))
        self.desc = torch.tensor(rows, dtype=torch.int64).to(dev)
        self.blk = torch.repeat_interleave(torch.arange(T, dtype=torch.int32), torch.tensor(nblk)).to(dev)
        # Sections laid out for an even count of rows: each starts 16-byte aligned whatever T is, so every plan
        # hands the kernel the same pointer alignment and one build serves them all (with T rows, an odd T put
        # ``words`` and ``hexs`` 8 bytes off: a second specialization, built on the job's thread at its point).
        R = T + T % 2
        self.o_words, self.o_hexs = R * _ACC, R * (_ACC + _WORDS // 2)
        self.buf = torch.zeros(R * (_ACC + _WORDS // 2 + _WORDS), dtype=torch.int64, device=dev)
        self.acc = self.buf[: R * _ACC]
        self.accf = self.acc.view(torch.float64)
        self.words = self.buf[self.o_words: self.o_hexs].view(torch.int32)
        self.hexs = self.buf[self.o_hexs:].view(torch.uint8)
        self.cuda = dev.type == "cuda"
        self._free: list[tuple[torch.Tensor, Any]] = []  # host copies and their events no launch holds now
        self.last: tuple[torch.Tensor, Any] | None = None  # the newest launch's: what ``columns()`` reads
        self._host_constants(tensors, nbytes, kinds)

    def _host_constants(self, tensors: list[torch.Tensor], nbytes: list[int], kinds: list[int]) -> None:
        """What turns the arrays into row values: counts, slices of the kernel's hex text, head fix-ups."""
        numels = [t.numel() for t in tensors]
        self.numel = np.asarray(numels, dtype=np.int64)
        self.bf16 = (np.asarray(kinds) == 0)[:, None]
        self.fp16 = np.flatnonzero(np.asarray(kinds) == 1)
        self.short_heads = [(i, n) for i, n in enumerate(numels) if n < HEAD]
        per = _WORDS * 8  # hex characters a tensor's row of the text holds
        self.raw_sl = _slicer([slice(i * per, i * per + 2 * raw_len(b)) for i, b in enumerate(nbytes)])
        self.win_sl = _slicer([slice(i * per + 2 * RAW_SMALL, i * per + 2 * RAW_SMALL + 2 * WINDOW * n_windows(b))
                               for i, b in enumerate(nbytes)])
        self.fp_sl = _slicer([slice(16 * i, 16 * i + 16) for i in range(len(nbytes))])

    def launch(self) -> tuple[torch.Tensor, Any]:
        """Zero the accumulators, run the kernel over every tensor, queue the copy back. Returns the launch's
        slot (its host copy and the event after it), for ``columns``: each launch copies into a slot of its own,
        so a point finished on the writer thread reads its own results while the job's next point launches."""
        cur = torch.cuda.current_device() if self.cuda else None
        if cur is not None and cur != self.device.index:
            with torch.cuda.device(self.device):
                return self.launch()
        if self.last is not None and self.last[1] is not None:
            # A point on another stream than the last (inside ``torch.cuda.stream``) must not zero the buffer before
            # the last launch's copy left it: its rows may be made on the writer, after this launch
            torch.cuda.current_stream(self.device).wait_event(self.last[1])
        self.acc.zero_()
        timing = _KERNEL_EVENTS is not None and self.cuda
        if timing:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        self._kernel(_TRITON.get("hint", True))
        if timing:
            ev1.record()
            _KERNEL_EVENTS.append((ev0, ev1))
        return self.copy_back()

    def copy_back(self) -> tuple[torch.Tensor, Any]:
        """Queue the copy of the results to the host, into a slot no earlier launch still holds."""
        if not self.cuda:  # the tests' CPU kernel (Triton's interpreter) ran already: a copy of its own
            self.last = (self.buf.clone(), None)
            return self.last
        try:
            slot = self._free.pop()
        except IndexError:  # list.pop is atomic: the writer may give one back meanwhile
            slot = (torch.empty(self.buf.shape, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
        slot[0].copy_(self.buf, non_blocking=True)
        slot[1].record()
        self.last = slot
        return slot

    def _kernel(self, hint: bool) -> None:
        if not _probe_nvrtc.ready(self.device):
            await_warm()  # an engine's warm-up still building: the kernel it builds, not a second build here
        if _probe_nvrtc.ready(self.device):
            return _probe_nvrtc.launch(self)  # NVRTC's build of the kernel: the same rows
        if not _triton_ok():
            raise RuntimeError(f"probe: no fused kernel for {self.device}: {_TRITON.get('why')}")
        self.triton(hint)

    def triton(self, hint: bool = True) -> None:
        """Triton's kernel over this plan (the benchmarks call it to compare it with NVRTC's)."""
        w = [o // 4 for o in WINDOW_OFFSETS]
        cap = {"maxnreg": MAXNREG} if MAXNREG else {}
        try:
            _TRITON["last"] = _TRITON["kernel"][(self.programs,)](
                self.desc, self.blk, self.acc, self.accf, self.words, self.hexs, BLOCK=WORDS_PER_ITER, ITERS=ITERS,
                HINT=hint, W0=w[0], W1=w[1], W2=w[2], W3=w[3], num_warps=NUM_WARPS, **cap)
        except Exception:  # Triton's compile errors differ by version: any one retries once, then is raised
            if not hint:
                raise
            _TRITON["hint"] = False  # this Triton refuses the alignment hint: go without it
            self.triton(False)

    def columns(self, stamp=None, slot: tuple[torch.Tensor, Any] | None = None) -> dict[str, list]:
        """Wait for the copy of ``slot`` (``launch``'s; left out, the newest launch's), then every statistic column
        as a list, in row order (``stamp``: a benchmark's timer, told when the copy is back)."""
        host, done = self.last if slot is None else slot
        if done is not None:
            wait(done, self.device)
        if stamp:
            stamp(("copied back", time.perf_counter()))
        try:
            return self._columns(host.numpy())
        finally:
            if done is not None and not any(h is host for h, _ in self._free):  # read twice (a benchmark): once
                self._free.append((host, done))  # read: the next launch may copy into it

    def _columns(self, h: np.ndarray) -> dict[str, list]:
        T = self.T
        a = h[: T * _ACC].reshape(T, _ACC)
        nan, inf = a[:, 0], a[:, 1]
        nfin = (self.numel - nan - inf).astype(np.float64)
        some = nfin > 0
        k = a[:, 5:7] ^ _FLIP  # min's key was stored as 2**32-1 - key (so atomic_max could fold it)
        bits = np.where(k & 0x80000000, k & 0x7FFFFFFF, k ^ _M32).astype(np.uint32).view(np.float32).astype(np.float64)
        lohi = np.where(some[:, None], bits, np.nan)
        mean = np.where(some, a[:, 7].view(np.float64) / np.maximum(nfin, 1.0), np.nan)
        sumsq = a[:, 8].view(np.float64)  # lanes summed in fp32 within a block, blocks in fp64
        fph = (a[:, 3:5] & _M32).astype(">u4").tobytes().hex()
        w = h[self.o_words: self.o_words + T * _WORDS // 2].view(np.uint32).reshape(T, _WORDS)
        hexs = h[self.o_hexs: self.o_hexs + T * _WORDS].tobytes().decode("ascii")
        return {
            "nan": nan.tolist(), "inf": inf.tolist(), "poisoned": a[:, 2].tolist(),
            "min": lohi[:, 0].tolist(), "max": lohi[:, 1].tolist(), "mean": mean.tolist(), "head": self._heads(w),
            "fingerprint": self.fp_sl(fph), "raw": self.raw_sl(hexs), "windows": self.win_sl(hexs),
            "sumsq": sumsq.tolist(),
        }

    def _heads(self, w: np.ndarray) -> list[list[float]]:
        """The first 8 values of every tensor, each read as its dtype: bf16 and fp32 as float32 bits (a bf16
        is the high half of one), in one conversion; fp16 rows, if any, on their own. The halves are the first
        four words read as 16-bit values (little-endian: a word's low half comes first), not shifted out of them
        (a third less time for a 279-row part's heads here)."""
        halves = w[:, : HEAD // 2].view(np.uint16)
        with np.errstate(invalid="ignore"):  # a signalling NaN (poison) widened is no error here
            heads = np.where(self.bf16, halves.astype(np.uint32) << 16, w[:, :HEAD]).view(np.float32).astype(np.float64)
            if self.fp16.size:
                heads[self.fp16] = halves[self.fp16].view(np.float16).astype(np.float64)
        out = heads.tolist()
        for i, n in self.short_heads:
            out[i] = out[i][:n]
        return out


def _slicer(slices: list[slice]) -> Callable[[str], list[str]]:
    """Every slice of a text as a list, cut in one C call (``itemgetter``): a quarter less time than a slice a call
    (a part's 251 raw-byte texts here, timed in place: 65 -> 48 us)."""
    get = operator.itemgetter(*slices)
    return (lambda text: [get(text)]) if len(slices) == 1 else (lambda text: list(get(text)))


def warm(device: torch.device | str | int | None = None) -> dict[str, Any]:
    """Build the kernel for ``device`` and run it once over a tensor of each kind, so a rank's first probe
    pays neither Triton's import nor its compile (seconds on a machine whose Triton cache is cold; the
    cache makes it one load per process after that). The kernel has one specialization (every pointer it
    gets is 16-byte aligned, every other argument a constant), so this build is the one every probe uses."""
    t0 = time.perf_counter()
    if not fused_enabled():
        return {"warm": False, "why": _TRITON.get("why", "fused probe off")}
    t1 = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        plan = Plan([torch.zeros(300, dtype=d, device=dev) for d in KINDS])  # > RAW_SMALL bytes: the window path too
        plan.launch()
        plan.columns()
    return {"warm": True, "device": str(dev), "import_s": t1 - t0, "build_s": time.perf_counter() - t1}


def warm_async(device: torch.device | str | int | None = None,
               plain_meanwhile: bool = False) -> threading.Thread | None:
    """The kernel's build on a daemon thread (once per process), started when a CUDA rank joins its group or at
    a job's first point: NVRTC's (about a second), else Triton's (``warm`` after a child's build; ~9 s on an
    H200 with a cold cache). A probe that comes sooner waits for the rest of it (``await_warm``), or, with
    ``plain_meanwhile`` (a job's capture: its points are not to wait), takes the plain torch path.
    WORKBENCH_PROBE_WARM=0 turns it off; WORKBENCH_PROBE_NVRTC=0 builds Triton's only."""
    if os.environ.get("WORKBENCH_PROBE_WARM", "1") == "0" or "thread" in _WARM or "result" in _WARM:
        return _WARM.get("thread")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if plain_meanwhile:
        _WARM["plain_meanwhile"] = True

    def run() -> None:
        try:
            if nvrtc:
                if _nvrtc(device):
                    return
                with _WARM_LOCK:
                    if _WARM.get("closing"):  # the job closed its capture meanwhile: no second build
                        _WARM["result"] = {"warm": False, "why": "the capture closed before the build ended"}
                        return
                    _WARM["phase"] = "child"
            _WARM["child"] = _build_aside(device)
            with _WARM_LOCK:
                if _WARM.get("closing"):  # the job closed its capture while the child built: nothing to load
                    _WARM["result"] = {"warm": False, "why": "the capture closed before the build ended"}
                    return
                _WARM["phase"] = "load"
            _WARM["result"] = warm(device)
        except Exception as exc:  # a thread's boundary: said in the result; the probe's plain path works without it
            _WARM["result"] = {"warm": False, "why": f"{type(exc).__name__}: {exc}"}

    nvrtc = _nvrtc_possible(device)
    t = threading.Thread(target=run, name="workbench-probe-warm", daemon=True)
    _WARM["thread"], _WARM["phase"] = t, "nvrtc" if nvrtc else "child"
    t.start()
    return t


def precompile_async() -> threading.Thread | None:
    """NVRTC's compile of the kernel for the GPUs' architecture (NVML's, no CUDA context), started as a job's capture
    opens, before its CUDA init: the warm-up that init starts then only loads it (``_probe_nvrtc.precompile``).
    Off with the warm-up (WORKBENCH_PROBE_WARM=0) or NVRTC's (WORKBENCH_PROBE_NVRTC=0); once per process."""
    if (os.environ.get("WORKBENCH_PROBE_WARM", "1") == "0" or os.environ.get("WORKBENCH_PROBE_NVRTC", "1") == "0"
            or "precompile" in _WARM):
        return None
    _WARM["precompile"] = t = _probe_nvrtc.precompile(_probe_nvrtc.source(WORDS_PER_ITER, ITERS))
    return t


def _nvrtc_possible(device: torch.device | str | int) -> bool:
    """Whether the warm-up tries NVRTC first: a CUDA device, and WORKBENCH_PROBE_NVRTC not 0 (Triton's build only)."""
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return dev.type == "cuda" and os.environ.get("WORKBENCH_PROBE_NVRTC", "1") != "0"


def _nvrtc(device: torch.device | str | int) -> bool:
    """NVRTC's build of the kernel on a CUDA device (about a second, no toolchain, the GIL free while NVRTC
    compiles): whether it loaded. Where it cannot (no NVRTC, an older torch), Triton's build follows; the
    reason is kept in ``_WARM["nvrtc"]``."""
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    _WARM["nvrtc"] = built = _probe_nvrtc.build(index, WORDS_PER_ITER, ITERS)
    if built.get("nvrtc"):
        _WARM["result"] = {"warm": True, "kernel": "nvrtc", "device": f"cuda:{index}", "build_s": built["build_s"],
                           "compiled_by": built.get("compiled_by")}  # ours ("ctypes") or torch's, and why
    return bool(built.get("nvrtc"))


def _build_aside(device: torch.device | str | int) -> dict[str, Any] | None:
    """On a CUDA device, the kernel's cold build in a child process (``probe_child.prebuild_probe``; started here
    unless the capture started it already), waited for here: the in-process warm-up after it only loads
    what the child left in Triton's cache, so the job's threads never run the compiler (which holds the GIL
    for seconds: every step run meanwhile slowed). What the child reported; None on CPU or with it off."""
    from workbench.rank import probe_child

    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        return None
    if not probe_child.prebuild_probe(dev.index if dev.index is not None else torch.cuda.current_device()):
        return None
    return probe_child.await_prebuild()


def settle_warm(limit: float) -> bool:
    """Wait up to ``limit`` seconds for a job's warm-up still building (``plain_meanwhile``); whether none runs now.
    A warm-up still waiting for its child build is told to load nothing and not waited for: the child builds
    in a process of its own, which the job's exit does not leave mid-build (a short job on a fresh machine
    would otherwise wait ~10 s at its close for a kernel it will never use)."""
    t = _WARM.get("thread")
    if t is None or not _WARM.get("plain_meanwhile") or t is threading.current_thread():
        return True
    with _WARM_LOCK:
        _WARM["closing"] = True
        if _WARM.get("phase") == "child":
            return True
    t.join(limit)
    return not t.is_alive()


def await_warm() -> None:
    """Wait for a warm-up still building the kernel (never from the warm-up's own thread)."""
    t = _WARM.get("thread")
    if t is not None and t is not threading.current_thread():
        t.join()
        _WARM.pop("thread", None)


def wait(event: torch.cuda.Event, device: torch.device) -> None:
    """Poll ``event``, never a blocking sync: a rank whose stream sits behind a stuck collective then
    reports it after the group's timeout instead of hanging inside the driver."""
    limit = _sync_limit()
    t0 = time.perf_counter()
    while not event.query():
        waited = time.perf_counter() - t0
        if limit is not None and waited > limit:
            raise RuntimeError(
                f"probe: the work queued on {device} did not finish within {limit:g}s; a collective on this "
                "rank's stream is probably stuck (its peer never posted the matching call)")
        if waited > 0.0005:
            # A point taken right after the job's step (an optimizer hook's) waits here for the step's queued
            # work, tens of ms: 0.1 ms sleeps end the wait within about that of the work's end (sleeps growing by
            # 0.2 ms each overslept it by ~1.5 ms a point on an H200). Past a second, a stuck collective's wait up
            # to the group's timeout, they grow to 10 ms.
            time.sleep(0.0001 if waited < 1.0 else min(0.01, waited / 100))


def _sync_limit() -> float | None:
    """The process group's timeout on an engine rank; None (wait for ever) elsewhere."""
    env = os.environ.get("WORKBENCH_PROBE_SYNC_TIMEOUT")
    if env:
        return float(env)
    from workbench.rank import state

    t = state.RANK.get("timeout_s")
    return float(t) if t else None
