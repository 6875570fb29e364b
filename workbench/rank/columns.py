"""The row vocabularies the ranks report in, without torch.

The probe (``probe.COLUMNS``) and the forward trace (``trace.TRACE_COLUMNS``) fill rows
with these names on the ranks; the client's frames, findings, JSON and bundles read them.
They live here so a client that only reads rows never imports torch to learn a column name.
"""

from __future__ import annotations

COLUMNS = [
    "rank", "name", "kind", "dtype", "device", "is_meta", "shape", "numel",
    "nan", "inf", "poisoned", "min", "max", "mean", "head", "fingerprint", "raw", "windows", "sumsq",
]
# ``sumsq``: the sum of squares of the finite values (float64). With ``mean`` (so the sum: mean x (numel - nan -
# inf)), min, max and the NaN/Inf counts it is a summary that adds up across shards: the same tensor sharded over
# 2 ranks or 4 compares through it (``workbench.postmortem.diff``). Rows recorded before it lack it.
TRACE_COLUMNS = [
    "rank", "run", "call", "module", "type", "dtype", "shape", "numel",
    "in_nonfinite", "nan", "inf", "absmax", "meanabs", "fingerprint", "device",
]
# Bytes kept at fixed offsets further in (``windows``: the windows that fit, concatenated): a transfer whose
# stream slid by some bytes (NCCL pairing a 256 B bucket with a larger one slides rank 1's tensors by 128 B)
# shows as one rank's window equal to another rank's bytes at another offset. The offsets' differences
# (with the first RAW_LARGE bytes) cover slides of 128-176, 256-304, 384, 512 B and more; 128 bytes a tensor.
WINDOW_OFFSETS = (128, 256, 512, 4096)
WINDOW = 32

KERNEL_KNOBS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # settings that let one CPU run another's kernels


def kernel_knobs() -> dict[str, str]:
    """This process's settings of the knobs that pick its float kernels (a record names what the ranks ran with)."""
    import os

    return {k: os.environ[k] for k in KERNEL_KNOBS if os.environ.get(k)}


def cpu_model() -> str:
    """The CPU model: float kernels (and so the last bits of a forward) depend on it."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
