"""An exception as the cause of a collective story: which rank raised what, where.

When a rank raises in the step where the ranks' collectives part (an assertion in the user's
step, a ``KeyError`` deep in a library), the peers are left waiting in a call it will never
issue; the ledger sees only the symptom ("rank 1 never issued call #4"). The exception is
the cause, so the diagnosis leads with it. An exception raised inside ``torch.distributed``
(a collective that timed out, a mispaired receive) is itself a symptom and never leads.
"""

from __future__ import annotations

import re
from typing import Any

import pandas as pd

from workbench.analysis.collectives import short_path
from workbench.analysis.stacks import _NOT_USER  # a library's, Python's or the rank plumbing's frame

_TORCH = re.compile(r"(site|dist)-packages>?[/\\]torch[/\\]")  # also a bundle's scrubbed <site-packages>
_PLUMBING = re.compile(r"[/\\]workbench[/\\](rank|live)[/\\]|/lib/python\d[^/]*/[^/]+\.py$|^<(string|frozen)")
_TB_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$', re.M)


def frames(tb: str) -> list[tuple[str, str, str]]:
    """(path, line, function) of each frame of a Python traceback text, outermost first."""
    return [(m["path"], m["line"], m["fn"].strip()) for m in _TB_FRAME.finditer(tb or "")]


def raised_at(tb: str) -> str:
    """Where the exception was raised, as the ledger places a call: the innermost frame outside torch
    (a library's or the user's), then the user's line when that is another frame:
    ``accelerate/utils/fsdp_utils.py:494 f (from scenario.py:40 load)``; empty when unknown."""
    fs = frames(tb)
    if not fs:
        return ""
    inner = next((f for f in reversed(fs) if not _TORCH.search(f[0]) and not _PLUMBING.search(f[0])), fs[-1])
    where = f"{short_path(f'{inner[0]}:{inner[1]}')} {inner[2]}"
    user = next((f for f in reversed(fs) if not _NOT_USER.search(f[0])), None)
    if user is not None and user != inner:
        where += f" (from {short_path(f'{user[0]}:{user[1]}')} {user[2]})"
    return where


_COLLECTIVE_ERROR = re.compile(
    r"\bgloo\b|\bnccl|timed out waiting|connection closed by peer|aborted by the workbench", re.I)


def is_symptom(tb: str, message: str = "") -> bool:
    """Raised by a collective itself (inside torch.distributed, the c10d op's own dispatch in
    ``torch/_ops.py``, or the backend's error reaching autograd as DDP's all-reduce does): a
    timeout, a mispaired receive, what a cause leaves behind."""
    fs = frames(tb)
    inner = fs[-1][0].replace("\\", "/") if fs else ""
    return ("/torch/distributed/" in inner or inner.endswith("/torch/_ops.py")
            or bool(_COLLECTIVE_ERROR.search((message or "").split("\n", 1)[0])))  # a backend's own words


def causes(events: pd.DataFrame, step: str) -> list[dict[str, Any]]:
    """The step's exceptions that are causes (not raised inside torch.distributed), in rank order."""
    if not len(events) or "kind" not in events.columns:
        return []
    ev = events[(events["kind"] == "error") & (events["step"] == step)].sort_values("rank")
    tb = ev["traceback"] if "traceback" in ev.columns else pd.Series([""] * len(ev), index=ev.index)
    return [dict(e) for (_, e), t in zip(ev.iterrows(), tb) if not is_symptom(str(t or ""), str(e["message"]))]


def lead(errors: list[dict[str, Any]], step: str, waiting: list[int]) -> str:
    """``rank 1 raised AssertionError at f.py:30 check in step `s`: msg; it left rank 0 waiting``."""
    e = errors[0]
    where = raised_at(str(e.get("traceback") or ""))
    text = (f"rank {int(e['rank'])} raised {e['error']}" + (f" at {where}" if where else "")
            + f" in step `{step}`: {str(e['message']).split(chr(10))[0][:200]}")
    text += "".join(f"; rank {int(o['rank'])} raised {o['error']}" for o in errors[1:])
    if waiting:
        text += f"; it left {'rank' if len(waiting) == 1 else 'ranks'} {','.join(map(str, waiting))} waiting"
    return text
