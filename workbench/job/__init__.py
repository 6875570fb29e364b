"""Inside the user's own job: capture under torchrun or srun, no ipyparallel, no notebook.

    import workbench.job as wj
    cap = wj.capture("runs/init")           # every rank: RANK/WORLD_SIZE from torchrun, or srun's SLURM_*
    cap.point("materialize", model=model)    # this rank's tensor rows now, the ledger since the last point
    cap.point("forward", model=model, logits=out)

No line of the script at all: ``workbench job runs/init -- torchrun ... train.py`` captures every rank
from its ``import torch``, with points after the calls incidents live in (``hooks.py``); a ``capture``
call in such a job returns that same capture.

Each rank writes its own shard (``runs/init/rank<r>/``) flushed at every point, so a job that
hangs or is killed still leaves everything it reached; the collective ledger's start line of a
call is on disk before the call runs, so the stuck call is named. The directory of shards opens
like any bundle (``workbench report runs/init``, ``wb.load``), through ``postmortem.shards``.

``capture(dir, ledger="calls")`` records the same ledger around ``torch.distributed``'s collective
functions only (no cost per op; ``torch.compile`` compiles); where the job runs PyTorch's debug server,
``ask(url)`` / ``fetch(urls, dir)`` (and ``workbench report URL,URL``) read a running rank's shard
through it. ``load(dir)`` is ``wb.load``; ``merge(dir, out)`` writes one ``.wbundle``.

``cap.breakpoint(deadline=...)`` (every rank) serves the ranks as ipyparallel engines for a notebook
(``wb.connect(job=dir)``) until its ``cluster.resume()`` or the deadline, then returns to the script
(``engine.py``); ``here()`` is the namespace the engines see, for functions ``cluster.run`` sends.
``capture(dir, attach="on-error" | "on-deadlock" | "post-mortem")``: the same, post mortem, once a rank
raises or the ledgers prove a deadlock; the ranks stuck in a collective serve from a thread of their own
(``triggers.py``), and after ``cluster.resume()`` the job fails as it would have.

Layer: above ``postmortem`` (whose shard format it writes) and below ``live``, which it never
imports; what runs in the job is rank-side code (``rank/``), and importing this package pulls
neither pandas nor ipyparallel.
"""

from __future__ import annotations

from typing import Any

from workbench.job.config import CaptureConfig
from workbench.job.debug_server import ask, ask_all, fetch
from workbench.job.engine import here
from workbench.job.shard import ENV_OFF, Capture, NoCapture, capture

__all__ = ["ENV_OFF", "Capture", "CaptureConfig", "NoCapture", "ask", "ask_all", "capture", "fetch", "here", "load",
           "merge"]


def load(path: Any) -> Any:
    """A directory of shards as a ``Bundle`` (what ``wb.load`` gives for it too)."""
    from workbench.postmortem import bundle

    return bundle.load(path)


def merge(path: Any, out: Any) -> Any:
    """A directory of shards written into one ``.wbundle`` file; returns its path."""
    from workbench.postmortem import bundle

    return bundle.save(bundle.load(path), out)
