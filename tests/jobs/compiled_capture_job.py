"""A ``torch.compile``d model under the capture's defaults (issue 46), and the same model eager, in one job.

A small model with a non-persistent buffer (``scale``) is built on meta, materialised with ``to_empty`` and its
weights initialised from a seed; the buffer is forgotten (the incident: ``to_empty`` leaves it unwritten). For
``eager`` then ``compiled`` (``torch.compile(backend=...)``, default ``eager``: dynamo's graph capture without a
compiler) the job captures into ``<out>/<mode>``, runs two forwards with a point after each, and writes what dynamo
counted to ``<out>/<mode>/dynamo<rank>.json``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.proj(x)) * self.scale)


out = Path(sys.argv[1])
backend = sys.argv[2] if len(sys.argv) > 2 else "eager"
dist.init_process_group("gloo")
rank = dist.get_rank()
for mode in ("eager", "compiled"):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cap = wj.capture(out / mode, points=["forward0", "forward1"])
    with torch.device("meta"):
        model = Scaled()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    run = torch.compile(model, backend=backend) if mode == "compiled" else model
    x = torch.linspace(-1, 1, 32).reshape(2, 16)
    for i in range(2):
        y = run(x)
        cap.point(f"forward{i}", model=model, logits=y.detach())
    cap.close()
    c = torch._dynamo.utils.counters
    (out / mode / f"dynamo{rank}.json").write_text(json.dumps({
        "unique_graphs": c["stats"]["unique_graphs"], "frames_ok": c["frames"]["ok"],
        "graph_breaks": sum(c["graph_break"].values())}))
dist.destroy_process_group()
