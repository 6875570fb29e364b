"""A stuck rank's Python stack, cut to what a reader needs: the main thread's innermost frames.

``Engines.stacks`` takes faulthandler dumps of every thread of a stuck engine (main thread
first). The frames that say where a rank waits are the innermost few of its main thread
(the collective, the wrapper that issued it, the step's own line); the engine's own threads
and the outer frames of the step runner are noise in a hang view, but stay one click away in
the report. Works on a live ``Hang`` and on a loaded bundle's hang record alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from workbench.analysis.collectives import short_path

INNERMOST = 8


def main_thread(dump: str) -> str:
    """The first thread block of a dump (``Engines.stacks`` puts the main thread there)."""
    blocks = [b for b in (dump or "").strip().split("\n\n") if b.strip()]
    return blocks[0].strip("\n") if blocks else ""


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<fn>.*)$')


def compact(frame: str) -> str:
    """``  File "/…/site-packages/torch/x.py", line 9 in f`` -> ``  torch/x.py:9 in f`` (other lines as they are)."""
    m = _FRAME.match(frame)
    return f"  {short_path(m['path'] + ':' + m['line'])} in {m['fn']}" if m else frame


def innermost(dump: str, n: int = INNERMOST) -> str:
    """The main thread's header and its ``n`` innermost frames (faulthandler lists the most recent
    call first), paths shortened, then how many outer frames were left out."""
    lines = main_thread(dump).splitlines()
    if not lines:
        return ""
    head, frames = (lines[0], lines[1:]) if not lines[0].lstrip().startswith("File ") else ("", lines)
    frames = [f for f in frames if f.strip()]
    out = ([head] if head else []) + [compact(f) for f in frames[:n]]
    shown = n
    if not any(is_user_frame(f) for f in frames[:n]):
        # deep inside a library (an FSDP all-gather is ~40 frames below the step): the step's own line too
        mine = next((i for i, f in enumerate(frames[n:], n) if is_user_frame(f)), None)
        if mine is not None:
            if mine > n:
                out.append(f"  … {mine - n} frame(s)")
            out.append(compact(frames[mine]))
            shown = mine + 1
    if len(frames) > shown:
        out.append(f"  … {len(frames) - shown} outer frame(s)")
    return "\n".join(out)


# libraries, Python's own files, code compiled from a string, the rank plumbing and the lab (bundles scrub paths to
# <site-packages>, <python>, <workbench>: those still match)
_NOT_USER = re.compile(r"site-packages|dist-packages|/lib/python\d|^<(string|frozen)"
                       r"|[/\\]workbench[/\\](rank|lab|live)[/\\]"
                       r"|[/\\](ipyparallel|ipykernel|IPython|tornado|zmq|traitlets|jupyter_client|asyncio)[/\\]")


def is_user_frame(frame: str) -> bool:
    """A frame of the code under study (a scenario step, a notebook cell), not of a library, Python
    itself or the workbench's rank plumbing."""
    m = _FRAME.match(frame)
    return bool(m) and not _NOT_USER.search(m["path"])


def stuck_ranks(hang: Any) -> list[dict[str, Any]]:
    """One row per rank that has a stack or is stuck: rank, where it waits, innermost frames, main thread.

    ``hang``: a ``collectives.Hang`` or its ``to_dict()`` (a bundle's manifest ``hangs`` entry).
    """
    stuck = _get(hang, "stuck") or {}
    stacks = _get(hang, "stacks") or {}
    stuck = {int(r): str(v) for r, v in stuck.items()}
    stacks = {int(r): str(v) for r, v in stacks.items()}
    return [{"rank": r, "where": stuck.get(r, ""), "innermost": innermost(stacks.get(r, "")),
             "main_thread": main_thread(stacks.get(r, ""))}
            for r in sorted(set(stuck) | set(stacks))]


def proof(hang: Any) -> str | None:
    """Why the open calls can never pair (a deadlock read from the ledgers), if the hang has one."""
    p = _get(hang, "proof")
    return str(p) if p else None


def headline(hang: Any) -> str:
    """The hang's first line: which step, and what caught it."""
    message = _get(hang, "message") or ""
    return str(message).splitlines()[0] if message else f"step {_get(hang, 'step')!r} hung"


def _get(hang: Any, key: str) -> Any:
    return hang.get(key) if isinstance(hang, Mapping) else getattr(hang, key, None)
