"""What of the job's world group outlives its ``destroy_process_group``, read at the capture's close.

Why: a group still referenced once the job destroyed it lives until the references go, and at interpreter exit that
is finalisation, with its backend's threads still running. On gloo a worker then dropping a backward's last work
takes the GIL during finalisation and aborts the rank after its last line ("terminate called without an active
exception"): the job exits 1 while every point read clean. DeepSpeed's ZeRO-3 does it to every job (each parameter
keeps its ``ds_process_group``, and its hooks keep the model alive); 3 of 60 plain runs of
``tests/jobs/stack_deepspeed.py`` aborted so, four at a time on a 2-core box (docs/stacks.md). The capture cannot
stop it and must not try (the job is the job's); it records who holds the group, and the report says it.

Cheap where nothing is wrong: one reference count at close; the referrers are looked up (a walk of every object the
collector tracks) only where the count says someone else holds the group.
"""

from __future__ import annotations

import gc
import sys
import types
from collections import Counter
from typing import Any

OWN = 3  # the owner's attribute, the local name here, getrefcount's argument


def outlived(owner: Any, attr: str) -> dict[str, Any] | None:
    """Who else holds ``getattr(owner, attr)`` (the world group, as the capture held it since its first point) once
    the job destroyed it: ``{"refs": n, "holders": "21 objects' `ds_process_group`, 4 more"}``; None where the job
    has not destroyed it (torch's registry holds it: no leak) or ``owner`` is its only holder."""
    import torch.distributed as dist

    pg = getattr(owner, attr, None)
    if pg is None or (dist.is_available() and dist.is_initialized()):
        return None
    refs = sys.getrefcount(pg) - OWN
    if refs <= 0:
        return None
    return {"refs": refs, "holders": _holders(pg, owner, refs)}


def _holders(pg: Any, owner: Any, refs: int) -> str:
    """The referrers of ``pg`` but ``owner`` by what they call it: an object's attribute by its name, else the
    referrer's type; the three most common, then how many more of the ``refs``. Only what the collector tracks is
    seen: a ``__dict__`` holding nothing but untracked objects (a process group is one) is not, and counts among
    the more; where none is seen, that is said (a transformers Trainer's DDP job: 2 references, none named)."""
    said: Counter[str] = Counter()
    for r in gc.get_referrers(pg):
        if r is owner or isinstance(r, types.FrameType):  # the capture, and this very call's frames
            continue
        names = r if isinstance(r, dict) else _attributes(r)
        keys = []  # a loop, not a comprehension: that would hold ``pg`` in a cell, a referrer of its own
        for k, v in names.items() if isinstance(names, dict) else ():
            if v is pg:
                keys.append(k)
        if keys and names is getattr(owner, "__dict__", None):
            continue
        said.update([f"objects' `{k}`" for k in keys] or [f"{type(r).__name__}s"])
    top = said.most_common(3)
    if not top:  # a dict of plain values only (the collector does not track it), a C extension's reference
        return "none that the garbage collector can name"
    rest = refs - sum(n for _, n in top)
    one = {what: what.replace("objects'", "object's") if what.startswith("objects'") else what[:-1] for what, _ in top}
    return ", ".join([f"{n} {what if n > 1 else one[what]}" for what, n in top] + ([f"{rest} more"] if rest else []))


def _attributes(obj: Any) -> Any:
    """An instance's own attributes (inline in the object since Python 3.11, so the object is the referrer), read
    past any ``__getattr__`` of the job's (none of its code runs here); None where it has none."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
