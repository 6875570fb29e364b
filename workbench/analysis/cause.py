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
_PLUMBING = re.compile(r"[/\\]workbench[/\\](rank|lab|live)[/\\]|/lib/python\d[^/]*/[^/]+\.py$|^<(string|frozen)"
                       r"|[/\\](ipyparallel|ipykernel|IPython|tornado|zmq|traitlets|jupyter_client|asyncio)[/\\]")
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
    r"\bgloo\b|\bnccl|timed out waiting|connection closed by peer|aborted by the workbench"
    r"|is not registered|has been destroyed", re.I)  # the last two: a group an abort or a recovery took away
# What c10d's Python wrappers raise when they refuse an argument (``src`` outside the group, a wrong tensor list):
# raised before anything went out, so the rank's own cause even though it is raised inside torch.distributed.
REFUSED = ("ValueError", "TypeError", "AssertionError", "KeyError", "IndexError", "AttributeError")
# ... and what the backend says when it refuses one at the call, before anything is sent:
# "ProcessGroupGloo::broadcast: invalid root rank: 3", "ProcessGroupGloo::scatter: Incorrect input list size 2"
_REFUSED_WORDS = re.compile(r"^ProcessGroup\w*::\w+: (invalid|incorrect|unsupported|expected|requires|must|only)",
                            re.I)


def is_symptom(tb: str, message: str = "", error: str = "") -> bool:
    """Raised by a collective itself (inside torch.distributed, the c10d op's own dispatch in
    ``torch/_ops.py``, or the backend's error reaching autograd as DDP's all-reduce does): a
    timeout, a mispaired receive, what a cause leaves behind. ``error`` (the exception's type name):
    an argument c10d refused (``REFUSED``) is a cause, unless the backend's own words say otherwise."""
    fs = [f[0].replace("\\", "/") for f in frames(tb)]
    inner = next((f for f in reversed(fs) if not _DISPATCH.search(f)), fs[-1] if fs else "")
    if _COLLECTIVE_ERROR.search((message or "").split("\n", 1)[0]):  # a backend's own words
        return True
    if error in REFUSED or _REFUSED_WORDS.search(message or ""):
        return False
    return "/torch/distributed/" in inner or inner.endswith("/torch/_ops.py")


# The frames an op passes through on its way to its kernel, whatever the op: torch's dispatch, the modes the
# workbench's ledger installs, dynamo's wrappers. Under the ledger's mode every op's innermost frame is
# ``torch/_ops.py``; the frame above them says which code called the op (a collective's own, or not).
_DISPATCH = re.compile(r"/torch/(_ops|_compile|overrides|_tensor)\.py$|/torch/_dynamo/"
                       r"|/torch/utils/_python_dispatch\.py$|(^|/)workbench/rank/ledger(_calls)?\.py$")


def causes(events: pd.DataFrame, step: str) -> list[dict[str, Any]]:
    """The step's exceptions that are causes (not raised inside torch.distributed), in rank order."""
    if not len(events) or "kind" not in events.columns:
        return []
    ev = events[(events["kind"] == "error") & (events["step"] == step)].sort_values("rank")
    tb = ev["traceback"] if "traceback" in ev.columns else pd.Series([""] * len(ev), index=ev.index)
    return [dict(e) for (_, e), t in zip(ev.iterrows(), tb)
            if not is_symptom(str(t or ""), str(e["message"]), str(e.get("error") or ""))]


_ADDRESS = re.compile(r"<(?:[\w.]+\.)?(\w+) object at 0x[0-9a-f]+>")


def message(e: dict[str, Any]) -> str:
    """The exception's first line, without the object addresses that differ rank to rank (``<ProcessGroup>``)."""
    return _ADDRESS.sub(r"<\1>", str(e.get("message") or "").split("\n")[0])[:200]


def alike(errors: list[dict[str, Any]], step: str) -> list[tuple[str, str, list[int]]]:
    """(clause, exception type, ranks) per distinct exception, its ranks together: ``ranks 0,3 raised ValueError
    at f.py:18 exchange in step `s`: Global rank 1 is not part of group <ProcessGroup>``."""
    from workbench.analysis.rankgroups import ranks_words as _ranks  # ranges on a mesh, as the sentence names them

    same: dict[tuple[str, str, str], list[int]] = {}
    for e in errors:
        key = (str(e["error"]), raised_at(str(e.get("traceback") or "")), message(e))
        same.setdefault(key, []).append(int(e["rank"]))
    return [(f"{_ranks(rs)} raised {err}" + (f" at {where}" if where else "") + f" in step `{step}`: {msg}", err, rs)
            for (err, where, msg), rs in same.items()]


def told(errors: list[dict[str, Any]], step: str) -> list[str]:
    """One clause per distinct exception, its ranks together (``alike``)."""
    return [text for text, _, _ in alike(errors, step)]
