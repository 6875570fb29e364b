"""The fused probe on CUDA, built by NVRTC: ``_probe_triton``'s kernel in CUDA C.

Why a second copy of one kernel: Triton builds its kernel with a toolchain (gcc for its C helpers and launcher)
into an on-disk cache, so on a fresh machine the build took 9-11 s, and a job's points meanwhile took the plain
torch path, a dozen passes over every tensor: 4.7x a Llama-1B step on an H200 (``fixtures/gpu/job_leave_on_1gpu.json``
at 0b91b8c). NVRTC ships inside torch's CUDA wheels; it builds this in about a second with no toolchain nor
cache, on a thread of the rank's own process (its ctypes calls release the GIL), and the kernel it builds ran
1.6x faster than Triton's on an H200 (``fixtures/gpu/probe_nvrtc_1gpu.json``). So on CUDA it is the kernel the
probe uses; Triton's stays where NVRTC cannot build (an older torch, no NVRTC library) and in the CPU tests,
which run it through Triton's interpreter.

The contract is ``_probe_triton.probe_all_kernel``'s, argument for argument, into a ``probe_fused.Plan``'s
buffers, so the rows are the same: counts, min, max, the head, the fingerprint and the raw bytes bit for bit; the
sum and the sum of squares up to float32 summation order. ``benchmarks/probe_nvrtc.py`` compares the two on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from typing import Any

import torch

from workbench.rank.columns import WINDOW_OFFSETS

THREADS = 256  # Triton's NUM_WARPS = 8
SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
#define PER (%(block)d * %(iters)d)
#define NT %(threads)d

struct St { float lo, hi, s, q; u32 h1, h2; int nn, ni, np; };

__device__ __forceinline__ float inf_f() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float half_f(u32 h) {
  float f; unsigned short s = (unsigned short)h;
  asm("cvt.f32.f16 %%0, %%1;" : "=f"(f) : "h"(s));
  return f;
}
__device__ __forceinline__ void unpack(u32 w, int kind, float &x0, float &x1) {
  if (kind == 0) { x0 = __uint_as_float(w << 16); x1 = __uint_as_float(w & 0xFFFF0000u); }
  else if (kind == 1) { x0 = half_f(w & 0xFFFFu); x1 = half_f(w >> 16); }
  else { x0 = __uint_as_float(w); x1 = x0; }
}
__device__ __forceinline__ void hash(u32 w, u32 idx, St &st) {
  u32 a = (w ^ (idx * 0x9E3779B1u)) * 0x85EBCA77u; a ^= a >> 15;
  u32 c = (w + idx * 0xC2B2AE3Du) * 0x27D4EB2Fu; c ^= c >> 13;
  st.h1 += a; st.h2 += c;
}
__device__ __forceinline__ void fast(float x, St &st) {
  st.lo = fminf(st.lo, x); st.hi = fmaxf(st.hi, x); st.s += x; st.q += x * x;
}
__device__ __forceinline__ void careful(float x, St &st) {
  if (x != x) st.nn++;
  else if (fabsf(x) == inf_f()) st.ni++;
  else fast(x, st);
}
__device__ __forceinline__ void reset(St &st) {
  st.lo = inf_f(); st.hi = -inf_f(); st.s = 0.f; st.q = 0.f; st.h1 = 0u; st.h2 = 0u;
}
__device__ __forceinline__ u32 key(float f) {
  u32 b = __float_as_uint(f);
  return (b >> 31) ? (b ^ 0xFFFFFFFFu) : (b | 0x80000000u);
}
// Sum over the block of one value per thread; every thread gets it (the shared slots are reused after).
template <typename T, typename F> __device__ T block_fold(T v, F f, T *sh) {
  for (int o = 16; o; o >>= 1) v = f(v, __shfl_down_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  T r = sh[0];
  for (int i = 1; i < NT / 32; ++i) r = f(r, sh[i]);
  return r;
}
struct Add { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct Min { __device__ float operator()(float a, float b) const { return fminf(a, b); } };
struct Max { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };

extern "C" __global__ void __launch_bounds__(NT) probe_all(
    const i64 *desc, const int *blk_t, u64 *acc, double *accf, int *words, unsigned char *hexs,
    int W0, int W1, int W2, int W3) {
  __shared__ float shf[NT / 32];
  __shared__ u32 shu[NT / 32];
  __shared__ int shi[NT / 32];
  const int pid = blockIdx.x;
  const int t = blk_t[pid];
  const i64 *row = desc + (i64)t * 4;
  const i64 n = row[1];
  const i64 local = pid - row[2];
  const int kind = (int)row[3];
  const u32 *base = (const u32 *)row[0];
  const i64 start = local * PER;
  St st; reset(st); st.nn = 0; st.ni = 0; st.np = 0;
  const bool full = start + PER <= n;
  if (full) {
    const uint4 *v = (const uint4 *)(base + start);
    #pragma unroll 4
    for (int m = 0; m < PER / (4 * NT); ++m) {
      const int j = threadIdx.x + m * NT;
      const uint4 w4 = v[j];
      const u32 ws[4] = {w4.x, w4.y, w4.z, w4.w};
      const u32 idx = (u32)(start + 4 * (i64)j + 1);
      #pragma unroll
      for (int k = 0; k < 4; ++k) {
        float x0, x1;
        hash(ws[k], idx + k, st);
        unpack(ws[k], kind, x0, x1);
        fast(x0, st);
        if (kind != 2) fast(x1, st);
      }
    }
  }
  float total = block_fold(st.s, Add(), shf);
  if (!full || !(fabsf(total) < inf_f())) {  // a tail, or a NaN, Inf or overflow was read: re-read carefully
    reset(st);
    for (i64 p = start + threadIdx.x; p < start + PER && p < n; p += NT) {
      const u32 w = base[p];
      float x0, x1;
      hash(w, (u32)(p + 1), st);
      unpack(w, kind, x0, x1);
      careful(x0, st);
      if (kind == 2) st.np += (w == 0x7FA5A5A5u);
      else {
        careful(x1, st);
        const u32 pz = kind == 0 ? 0x7FA5u : 0x7D5Au;
        st.np += ((w & 0xFFFFu) == pz) + ((w >> 16) == pz);
      }
    }
    total = block_fold(st.s, Add(), shf);
  }
  const float q = block_fold(st.q, Add(), shf);
  const float lo = block_fold(st.lo, Min(), shf);
  const float hi = block_fold(st.hi, Max(), shf);
  const u32 h1 = block_fold(st.h1, Add(), shu);
  const u32 h2 = block_fold(st.h2, Add(), shu);
  const int nn = block_fold(st.nn, Add(), shi);
  const int ni = block_fold(st.ni, Add(), shi);
  const int np = block_fold(st.np, Add(), shi);
  if (threadIdx.x == 0) {
    u64 *a = acc + (i64)t * 9;
    double *af = accf + (i64)t * 9;
    atomicAdd(a + 0, (u64)nn); atomicAdd(a + 1, (u64)ni); atomicAdd(a + 2, (u64)np);
    atomicAdd(a + 3, (u64)h1); atomicAdd(a + 4, (u64)h2);
    atomicMax(a + 5, (u64)(0xFFFFFFFFu - key(lo))); atomicMax(a + 6, (u64)key(hi));
    atomicAdd(af + 7, (double)total); atomicAdd(af + 8, (double)q);
  }
  if (local == 0 && threadIdx.x < 96) {  // the first 64 words, then 8 at each window offset, and their hex
    const int o = threadIdx.x;
    const int k = (o - 64) / 8;
    const int win = (k == 0 ? W0 : k == 1 ? W1 : k == 2 ? W2 : W3) + (o - 64) %% 8;
    const i64 src = o < 64 ? o : win;
    const u32 w = src < n ? base[src] : 0u;
    words[(i64)t * 96 + o] = (int)w;
    for (int j = 0; j < 8; ++j) {
      const u32 nib = (w >> ((j / 2) * 8 + (1 - j %% 2) * 4)) & 0xFu;
      hexs[(i64)t * 768 + o * 8 + j] = (unsigned char)(nib + 48 + (nib > 9) * 39);
    }
  }
}
"""

_K: dict[str, Any] = {}
_LOCK = threading.Lock()


def source(block: int, iters: int) -> str:
    """The kernel's CUDA source for a plan's words per iteration and iterations (``probe_fused``'s constants)."""
    return SOURCE % {"block": block, "iters": iters, "threads": THREADS}


def build(device: int, block: int, iters: int) -> dict[str, Any]:
    """Compile and load the kernel for CUDA device ``device`` (once per process); what it took, or why not.
    NVRTC missing, a torch without ``torch.cuda._compile_kernel``, a driver refusing the PTX: each leaves
    ``why``, and the probe builds Triton's kernel instead (``probe_fused.warm_async``). ``block`` and ``iters``:
    the plan's words a program reads per iteration and its iterations (``probe_fused.WORDS_PER_ITER``, ``ITERS``)."""
    with _LOCK:
        if "kernel" in _K:
            return _K["result"]
        if "why" in _K:
            return {"nvrtc": False, "why": _K["why"]}
        t0 = time.perf_counter()
        try:
            with torch.cuda.device(device):
                # a thread new to CUDA has no current context, and NVRTC's module load is a driver call that needs
                # one ("invalid device context" on the warm-up's thread): a runtime call binds the device's own
                torch.cuda.current_stream(device).query()
                src = source(block, iters)
                try:
                    kernel, how = compile_kernel(src, "probe_all", device), "ctypes"
                except Exception as exc:  # NVRTC's C API as this torch finds it refused: torch's own build
                    why_not = f"{type(exc).__name__}: {exc}"
                    kernel, how = _torch_compile(src, "probe_all"), f"torch ({why_not})"
        # a boundary with a third party (NVRTC, the driver, torch's private API): any failure means this kernel
        # is not used, said in ``why`` (the warm-up's result keeps it); Triton's and the plain path remain
        except Exception as exc:
            _K["why"] = f"{type(exc).__name__}: {exc}"
            return {"nvrtc": False, "why": _K["why"]}
        _K.update(kernel=kernel, device=device,
                  result={"nvrtc": True, "build_s": time.perf_counter() - t0, "compiled_by": how})
        return _K["result"]


def compile_kernel(source: str, name: str, device: int) -> Any:
    """``torch.cuda._compile_kernel`` without what this kernel does not use: its header search. Why: torch's looks
    CUDA's headers up through ``torch.utils.cpp_extension``, which imports setuptools, which appends its
    ``_vendor`` folder to ``sys.path``. That ran on our warm-up thread, at the job's CUDA start: the job's own
    imports then saw setuptools' vendored packages, and raced ours (one job's ``from transformers import
    LlamaForCausalLM`` failed beside it, once). This source includes no header, so NVRTC compiles it for the
    device's architecture alone (or the capture's open compiled it already: ``precompile``); the module loads as
    torch's does (``_cuda_load_module``)."""
    from torch.cuda import _utils

    major, minor = torch.cuda.get_device_capability(device)
    binary, mangled = compile_cubin(source, name, f"sm_{major}{minor}")
    return _utils._cuda_load_module(binary, [mangled])[mangled]


_CUBINS: dict[tuple[str, str, str], tuple[bytes, str]] = {}  # (source, name, arch) -> the cubin and its entry's name
_COMPILING = threading.Lock()  # one compile at a time: a build that meets the capture's precompile waits for it


def compile_cubin(source: str, name: str, arch: str) -> tuple[bytes, str]:
    """NVRTC's cubin of ``source`` for ``arch`` (``sm_90``) and the lowered name of ``name``, once per process. No
    CUDA context is needed: only the load is a driver call."""
    with _COMPILING:
        hit = _CUBINS.get((source, name, arch))
        if hit is None:
            hit = _CUBINS[(source, name, arch)] = _nvrtc_compile(source, name, arch)
        return hit


def _nvrtc_compile(source: str, name: str, arch: str) -> tuple[bytes, str]:
    from torch.cuda import _utils

    nvrtc = getattr(_utils, "_get_gpu_rtc_library", _utils._get_nvrtc_library)()

    def check(result: int) -> None:
        if result != 0:
            say = nvrtc.nvrtcGetErrorString  # const char *nvrtcGetErrorString(nvrtcResult)
            say.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC: {(say(result) or b'error %d' % result).decode(errors='replace')}")

    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None))
    try:
        check(nvrtc.nvrtcAddNameExpression(prog, name.encode()))
        options = [f"--gpu-architecture={arch}".encode()]
        result = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name}: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        binary = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(prog, binary))
        lowered = ctypes.c_char_p()
        check(nvrtc.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)))
        mangled = lowered.value.decode() if lowered.value else name
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return binary.raw, mangled


def precompile(source: str, archs: set[str] | None = None) -> threading.Thread | None:
    """The kernel compiled on a daemon thread for ``archs`` (default: every GPU's, as NVML reads them: no CUDA
    context, so a capture may start it as it opens). Why: the warm-up starts at the job's CUDA init and, on a fresh
    machine, NVRTC took 0.58 s there, longer than a job's way from that init to its ``to_empty`` point, whose probe
    then took the plain path: 529 ms (``fixtures/gpu/job_leave_on_race_1gpu.json``, cc51d85). With the cubin made
    before, CUDA's init leaves only the load: 0.11 s, and that point 11.0 ms (``job_leave_on_1gpu.json``, 4d040dd).
    Where NVML or NVRTC cannot answer, nothing is made (the warm-up compiles as before); what went wrong is kept in
    ``_K["precompile"]``. NVML's init, like the compile, runs on the thread, not on the job's."""
    lib = _nvml() if archs is None else None
    if archs is None and lib is None:
        return None

    def run() -> None:
        for arch in sorted(_nvml_archs(lib) if archs is None else archs):
            try:
                compile_cubin(source, "probe_all", arch)
            except Exception as exc:  # a thread's boundary with NVRTC: the warm-up's own compile says it again
                _K["precompile"] = f"{arch}: {type(exc).__name__}: {exc}"

    t = threading.Thread(target=run, name="workbench-probe-precompile", daemon=True)
    t.start()
    return t


def _nvml() -> Any:
    """NVML's library, or None where the driver has none (a box without GPUs)."""
    try:
        return ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None


def _nvml_archs(lib: Any = None) -> set[str]:
    """Every GPU's architecture (``sm_90``) as NVML reads it: no CUDA context made. Empty where NVML is absent."""
    lib = lib or _nvml()
    try:
        if lib is None or lib.nvmlInit_v2() != 0:
            return set()
    except AttributeError:
        return set()
    archs: set[str] = set()
    try:
        count = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return archs
        for i in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if (lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) == 0
                    and lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0):
                archs.add(f"sm_{major.value}{minor.value}")
        return archs
    finally:
        lib.nvmlShutdown()


def _torch_compile(source: str, name: str) -> Any:
    """torch's own build, where ours could not: ``sys.path`` given back as it was (its setuptools import appends
    to it; what it imported stays imported)."""
    before = list(sys.path)
    try:
        return torch.cuda._compile_kernel(source, name)
    finally:
        for entry in [e for e in sys.path if e not in before]:
            with contextlib.suppress(ValueError):  # the job took it out meanwhile
                sys.path.remove(entry)


def loaded() -> int | None:
    """The CUDA device index the kernel is loaded for; None before (or without) a build."""
    return _K.get("device") if "kernel" in _K else None


def ready(device: torch.device) -> bool:
    """Whether the kernel is loaded for ``device`` (no wait)."""
    return "kernel" in _K and device.type == "cuda" and _K["device"] == device.index


def launch(plan: Any) -> None:
    """The kernel over a ``probe_fused.Plan`` (its accumulators zeroed), on the current stream.

    Straight through the driver with the plan's argument array, made once per plan (its buffers never move):
    torch's launcher rebuilds the array, looks up the driver library and the stream at every call (0.27 ms a
    launch on an H200 host, two launches a point). Where torch's kernel object lacks what that needs, its own
    launcher runs."""
    fast = plan.__dict__.get("_nvrtc")
    if fast is None:
        fast = plan._nvrtc = _direct(plan)
    if fast is False:
        w = [o // 4 for o in WINDOW_OFFSETS]
        _K["kernel"](grid=(plan.programs, 1, 1), block=(THREADS, 1, 1),
                     args=[plan.desc, plan.blk, plan.acc, plan.accf, plan.words, plan.hexs, *w])
        return
    lib, func, array, _ = fast
    stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(plan.device.index))
    res = lib.cuLaunchKernel(func, plan.programs, 1, 1, THREADS, 1, 1, 0, stream, array, None)
    if res != 0:
        raise RuntimeError(f"probe: cuLaunchKernel returned CUDA error {res}")


def _direct(plan: Any) -> tuple | bool:
    """The driver, the kernel's function and the plan's argument array (with what it points to, held); False
    where torch's private launcher does not expose them."""
    try:
        lib = torch.cuda._utils._get_gpu_runtime_library()
        func = _K["kernel"].func
        _ = torch._C._cuda_getCurrentRawStream
    except AttributeError:  # another torch: its own launcher
        return False
    held = [ctypes.c_void_p(t.data_ptr()) for t in (plan.desc, plan.blk, plan.acc, plan.accf, plan.words, plan.hexs)]
    held += [ctypes.c_int(o // 4) for o in WINDOW_OFFSETS]
    array = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in held])
    return lib, func, array, held
