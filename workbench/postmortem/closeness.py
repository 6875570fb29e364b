"""What "the same values, within rounding" means when a rerun's bytes differ from its recording.

Another CPU (or another vector width of the same one: ``ATEN_CPU_CAPABILITY``) runs other float
kernels: reductions sum in another order, ``normal_`` fills another way, and the last bits of
every computed tensor move. Measured here (tiny Qwen3, kernels without SIMD against AVX2): fp32
weights 4.9e-7 and fp32 logits 6.4e-7 of the tensor's largest value, bf16 logits 3.8e-3. A bug
moves values by the tensor's whole size or more (another dtype's bytes, zeros for values, a
stream slid by a bucket, NaN where poison was never overwritten).

So two rows of the same (step, rank, tensor) agree "within rounding" when:

- dtype, shape, meta-ness and never-written-ness are the same, and NaN, Inf and poison counts
  are equal: a poison or NaN pattern is the story, never rounding (NaN, Inf and the poison
  bits at the same places among the kept bytes; a computed NaN's payload is not compared);
- every value the row keeps (min, max, mean, the first values, the first bytes, which are the
  whole tensor up to 256 B, and the byte windows further in) differs by at most
  ``RTOL[dtype] * scale``, where ``scale`` is the tensor's largest finite magnitude in either
  run; a NaN or Inf in the kept values must sit at the same place with the same bits;
- ``dtype`` is the narrowest float type the run computes in: a bf16 model's fp32 logits carry
  bf16 rounding.

``RTOL``: fp32 2^-16 (128 fp32 ulps at the tensor's scale: reduction order over a few layers),
bf16 2^-5 and fp16 2^-8 (4 ulps of each: one rounding flip upstream, carried through a layer),
fp64 2^-40. Integer and bool tensors must match exactly.

What a row keeps is a summary, not the tensor: a change confined to the middle of a large
tensor that moves none of the kept values passes as rounding (its fingerprint still says the
bytes differ, and the verdict counts such rows). Memory that was never written, without poison,
holds whatever the allocator left: only its written state is compared, never its values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

RTOL = {"float64": 2.0 ** -40, "float32": 2.0 ** -16, "float16": 2.0 ** -8, "bfloat16": 2.0 ** -5}
ULPS = {"float64": 4096, "float32": 128, "float16": 4, "bfloat16": 4}  # RTOL in ulps of each dtype
_WIDTH = {"float64": 64, "float32": 32, "float16": 16, "bfloat16": 16}
_NP = {"float64": "<f8", "float32": "<f4", "float16": "<f2"}
GARBAGE = ("never written", "partly written")
# rank/poison.py's fill patterns (NaN payloads no computation produces); repeated here: the client imports no torch
POISON_BITS = {"float32": 0x7FA5A5A5, "bfloat16": 0x7FA5, "float16": 0x7D5A, "float64": 0x7FF4A5A5A5A5A5A5}


@dataclass
class Gap:
    """How two rows of one tensor compare: ``story`` (why they tell another story) or ``None``."""

    delta: float = 0.0  # the largest |difference| over the kept values
    tol: float = 0.0
    story: str | None = None
    same_bytes: bool = True
    garbage: bool = False  # never-written memory without poison: values not compared


def floor_dtype(*tables: Any) -> str:
    """The narrowest float dtype among the tables' ``dtype`` columns (float32 when none)."""
    seen = set()
    for df in tables:
        if df is not None and len(df) and "dtype" in df:
            seen |= {str(d) for d in df["dtype"].dropna().unique()}
    floats = [d for d in RTOL if d in seen]
    return max(floats, key=RTOL.__getitem__) if floats else "float32"


def rtol(dtype: str, floor: str = "float32") -> float | None:
    """The tolerance (of the scale) for a row of ``dtype`` in a run computing down to ``floor``;
    ``None`` for dtypes that must match exactly."""
    if dtype not in RTOL:
        return None
    return max(RTOL[dtype], RTOL.get(floor, 0.0))


def tolerance_words(dtype: str, floor: str = "float32") -> str:
    d = floor if RTOL.get(floor, 0.0) > RTOL.get(dtype, 0.0) else dtype
    return f"{ULPS[d]} {d} ulps of the tensor's scale" if d in ULPS else "exact"


def _close(x: float | None, y: float | None) -> bool:
    return x == y or (x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6))


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, (str, bytes)):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


def _values(hex_bytes: Any, dtype: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(values as float64, raw bit patterns) of kept bytes; None when nothing was kept."""
    if not isinstance(hex_bytes, str) or not hex_bytes:
        return None
    data = bytes.fromhex(hex_bytes)
    width = _WIDTH.get(dtype)
    if width is None:
        return None
    n = len(data) // (width // 8)
    data = data[: n * (width // 8)]
    if dtype == "bfloat16":
        bits = np.frombuffer(data, dtype="<u2")
        vals = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        bits = np.frombuffer(data, dtype=f"<u{width // 8}")
        vals = np.frombuffer(data, dtype=_NP[dtype]).astype(np.float64)
    return vals, bits


def _same_specials(a: np.ndarray, b: np.ndarray, ba: np.ndarray | None, bb: np.ndarray | None,
                   dtype: str = "") -> bool:
    """NaN and Inf at the same places, and the poison pattern at the same places where bits are known.
    A computed NaN's payload is whichever operand's NaN an op propagated: not part of the story."""
    if not (np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[np.isinf(a)], b[np.isinf(b)])):
        return False
    bits = POISON_BITS.get(dtype)
    if ba is not None and bb is not None and bits is not None:
        return bool(np.array_equal(ba == bits, bb == bits))
    return True


def _max_gap(a: np.ndarray, b: np.ndarray) -> float:
    fin = np.isfinite(a) & np.isfinite(b)
    return float(np.max(np.abs(a[fin] - b[fin]))) if fin.any() else 0.0


def _scale(a: dict[str, Any], b: dict[str, Any]) -> float:
    vals = [abs(v) for r in (a, b) for v in (_num(r.get("min")), _num(r.get("max"))) if v is not None and
            math.isfinite(v)]
    return max(vals, default=0.0)


def compare(a: dict[str, Any], b: dict[str, Any], floor: str = "float32", poison: bool = True) -> Gap:
    """Compare one tensor's row in the recording (``a``) with its row in the rerun (``b``)."""
    for key in ("dtype", "shape"):
        if str(a.get(key)) != str(b.get(key)):
            return Gap(story=f"{key} {a.get(key)} then, {b.get(key)} now", same_bytes=False)
    if _flag(a.get("is_meta")) != _flag(b.get("is_meta")):
        return Gap(story=f"{'meta' if _flag(a.get('is_meta')) else 'real'} then, "
                         f"{'meta' if _flag(b.get('is_meta')) else 'real'} now", same_bytes=False)
    wa, wb = _written(a), _written(b)
    if wa != wb:
        return Gap(story=f"{wa or 'written'} then, {wb or 'written'} now", same_bytes=False)
    if a.get("fingerprint") == b.get("fingerprint"):
        return Gap()
    if not poison and wa in GARBAGE:
        return Gap(same_bytes=False, garbage=True)
    for key, say in (("nan", "NaN"), ("inf", "Inf"), ("poisoned", "poisoned")):
        x, y = _num(a.get(key)), _num(b.get(key))
        if (x or 0) != (y or 0):
            return Gap(story=f"{_int(x)} {say} then, {_int(y)} now", same_bytes=False)
    dtype = str(a.get("dtype"))
    tol_r = rtol(dtype, floor)
    if tol_r is None:
        return Gap(story=f"different {dtype} values (compared exactly)", same_bytes=False)
    tol = tol_r * _scale(a, b)
    delta, story = _kept_gap(a, b, dtype)
    if story is None and delta > tol:
        story = f"values off by up to {delta:.3g} (tolerance {tol:.3g}: {tolerance_words(dtype, floor)})"
    return Gap(delta=delta, tol=tol, story=story, same_bytes=False)


def _kept_gap(a: dict[str, Any], b: dict[str, Any], dtype: str) -> tuple[float, str | None]:
    """The largest gap over the kept values, or why their NaN/Inf patterns differ."""
    delta = 0.0
    for key in ("min", "max", "mean"):
        x, y = _num(a.get(key)), _num(b.get(key))
        xf, yf = x is not None and math.isfinite(x), y is not None and math.isfinite(y)
        if xf != yf:
            return 0.0, f"{key} {x} then, {y} now"
        if xf and yf:
            delta = max(delta, abs(x - y))
    ha = np.asarray([_num(v) if _num(v) is not None else math.nan for v in (a.get("head") or [])], dtype=float)
    hb = np.asarray([_num(v) if _num(v) is not None else math.nan for v in (b.get("head") or [])], dtype=float)
    if len(ha) != len(hb) or not _same_specials(ha, hb, None, None):
        return delta, "NaN/Inf at other places among the first values"
    delta = max(delta, _max_gap(ha, hb))
    for key in ("raw", "windows"):
        va, vb = _values(a.get(key), dtype), _values(b.get(key), dtype)
        if va is None or vb is None:
            continue
        if len(va[0]) != len(vb[0]) or not _same_specials(va[0], vb[0], va[1], vb[1], dtype):
            return delta, "NaN/Inf/poison bits at other places among the kept bytes"
        delta = max(delta, _max_gap(va[0], vb[0]))
    return delta, None


def compare_trace(a: dict[str, Any], b: dict[str, Any], floor: str = "float32") -> Gap:
    """One module call of the forward trace: non-finite counts exactly, magnitudes within rounding."""
    if a.get("fingerprint") == b.get("fingerprint") and str(a.get("dtype")) == str(b.get("dtype")):
        return Gap()
    for key in ("dtype", "shape"):
        if str(a.get(key)) != str(b.get(key)):
            return Gap(story=f"{key} {a.get(key)} then, {b.get(key)} now", same_bytes=False)
    for key in ("in_nonfinite", "nan", "inf"):
        if (_num(a.get(key)) or 0) != (_num(b.get(key)) or 0):
            return Gap(story=f"{_int(_num(a.get(key)))} {key} then, {_int(_num(b.get(key)))} now", same_bytes=False)
    dtype = str(a.get("dtype"))
    if dtype.startswith(("int", "uint")) or dtype == "bool":
        # an index output (top-k experts, argmax): two scores that tie within rounding may swap places in it,
        # so its bytes move with the kernels while its range and mean stay; a token sent to another expert
        # moves them, and shows in the experts' own calls (their shapes) right after
        # (the mean is a float sum of the indices: its last bits move with the reduction's kernel too)
        if all(_close(_num(a.get(k)), _num(b.get(k))) for k in ("absmax", "meanabs")):
            return Gap(same_bytes=False)
        return Gap(story=f"different {dtype} values (other picks, not only another order)", same_bytes=False)
    tol_r = rtol(dtype, floor)
    if tol_r is None:
        return Gap(story=f"different {dtype} values (compared exactly)", same_bytes=False)
    scale = max((abs(v) for v in (_num(a.get("absmax")), _num(b.get("absmax"))) if v is not None
                 and math.isfinite(v)), default=0.0)
    delta = max((abs(x - y) for x, y in ((_num(a.get(k)), _num(b.get(k))) for k in ("absmax", "meanabs"))
                 if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)), default=0.0)
    tol = tol_r * scale
    story = None if delta <= tol else (f"activations off by up to {delta:.3g} "
                                       f"(tolerance {tol:.3g}: {tolerance_words(str(a.get('dtype')), floor)})")
    return Gap(delta=delta, tol=tol, story=story, same_bytes=False)


def _written(row: dict[str, Any]) -> str | None:
    """'never written' / 'partly written', else None: 'written' and 'not tracked' (a tensor to_empty did not
    hand out, or whose tracking the allocator's reuse of an address dropped) both hold written values."""
    w = row.get("written")
    return w if w in GARBAGE else None


def _flag(v: Any) -> bool:
    return bool(v) and v == v  # None, NaN (a column pandas widened), False, 0.0: not set


def _int(x: float | None) -> str:
    return "0" if x is None or x != x else str(int(x))
