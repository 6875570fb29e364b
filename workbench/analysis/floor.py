"""An output's distance from its reference, judged against the engine's own floor.

Most outputs are computed the way their reference is (the same kernels on the same rank), so
anything above rounding (``ABS``) is a departure. An inference engine is different: vLLM's CPU
kernels put its log-probs some distance from the trainer's even with exactly the right weights,
and that distance depends on the CPU (about 0.02 on an AMD EPYC, 0.066 on a Xeon with AMX, for
the same weights). A fixed threshold tuned on one machine makes every fix "fail" on another.

So a scenario that scores an engine also reports ``ref_floor``: the same statistic for the
same engine, in the same run, serving the right weights. An output departs when it is above
``LEVEL`` times that floor (and above ``ABS``); the sentence gives both numbers. Without a floor
(NaN or absent) the fixed ``ABS`` applies, as before.
"""

from __future__ import annotations

import math
from typing import Any

ABS = 1e-3  # rounding between two computations of the same thing (bf16 round trips included)
LEVEL = 1.5  # a right result, in units of the engine's own floor measured in the same run


def number(v: Any) -> float | None:
    """A float for numbers (inf included), None for anything else: None, NaN and NA (a table's empty cell),
    bools and text."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def floor_of(v: Any) -> float | None:
    """The engine's floor as a finite number, or None when the output has none."""
    f = number(v)
    return f if f is not None and math.isfinite(f) else None


def tolerance(floor: Any = None) -> float:
    """How far an output may be from its reference and still be right."""
    f = floor_of(floor)
    return ABS if f is None else max(ABS, LEVEL * f)


def departs(diff: Any, floor: Any = None) -> bool:
    """True for an infinite distance (a NaN output's) or one above the tolerance; False when there is none."""
    d = number(diff)
    if d is None:
        return False
    return not math.isfinite(d) or d > tolerance(floor)


def words(diff: Any, floor: Any = None) -> str:
    """``departs from the reference by 0.91, the engine's own floor 0.066 in this run``, or the plain form."""
    d = number(diff)
    f = floor_of(floor)
    out = f"departs from the reference by {_fmt(d)}"
    return out + (f", the engine's own floor {_fmt(f)} in this run" if f is not None else "")


def within_words(name: str, diff: Any, floor: Any) -> str:
    """``logprobs` 0.066 from the reference, the engine's own floor 0.066 in this run: within it``."""
    return (f"`{name}` {_fmt(number(diff))} from the reference, the engine's own floor {_fmt(floor_of(floor))} "
            "in this run: within it")


def _fmt(v: float | None) -> str:
    if v is None:
        return "?"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.3g}"
