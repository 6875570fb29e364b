"""Synthetic probe tables with the headline incident's shape, at any number of ranks.

For views and benchmarks at rank counts no machine here can start (16, 64): rank 0 holds
the right tensors, ranks 1.. hold the same garbage (rank 0's fp32 ``inv_freq`` bytes read
as bf16, weights never written), and one ``odd`` rank holds zeros, as the incident's
ranks 1-15 did. Real probe rows, so every view and detector reads them as it reads a run.
"""

from __future__ import annotations

import pandas as pd
import torch

from workbench.analysis.frames import table
from workbench.rank.poison import poison_
from workbench.rank.probe import COLUMNS, probe_tensors


def incident_step(n_ranks: int, n_tensors: int = 12, step: str = "wrap_fsdp1", index: int = 2,
                  odd: int | None = 3, weight_numel: int = 64) -> pd.DataFrame:
    """One step's rows for ``n_ranks`` ranks and ``n_tensors`` tensors, with ``step``/``step_index``."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    weights = [torch.linspace(-1, 1, weight_numel + i).to(torch.bfloat16) for i in range(n_tensors - 1)]
    rows = []
    for rank in range(n_ranks):
        if rank == 0:
            buf, ws = inv_freq, weights
        elif rank == odd:
            buf, ws = torch.zeros(32, dtype=torch.bfloat16), [torch.zeros_like(w) for w in weights]
        else:  # rank 0's fp32 bytes landed in a bf16 buffer; the rest was never written
            buf, ws = inv_freq[:16].contiguous().view(torch.bfloat16), [poison_(torch.empty_like(w)) for w in weights]
        items = [("model.rotary_emb.inv_freq", "non-persistent buffer", buf)]
        items += [(f"model.layers.{i}.weight", "parameter", w) for i, w in enumerate(ws)]
        rows += probe_tensors(items, rank)
    df = table(rows, COLUMNS)
    df.insert(0, "step_index", index)
    df.insert(0, "step", step)
    return df
