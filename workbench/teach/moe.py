"""Exercise 03's model: the incident's toy MoE with a second buffer that escapes the meta context.

Rank side only (imports torch at the top): ``steps.build_scaled_moe`` imports it on the ranks.
"""

from __future__ import annotations

import torch

from workbench.lab.toy_moe import Router, TinyMoE


class ScaledRouter(Router):
    """The incident's router plus a per-expert gate scale, also registered with an explicit device."""

    def __init__(self, hidden: int, experts: int, top_k: int, bias_device: torch.device):
        super().__init__(hidden, experts, top_k, bias_device)
        self.register_buffer("gate_scale", torch.ones(experts, device=bias_device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, gates = super().forward(x)
        return chosen, gates * self.gate_scale[chosen]


class ScaledMoE(TinyMoE):
    def __init__(self, vocab: int, hidden: int, experts: int, top_k: int, bias_device: torch.device):
        super().__init__(vocab, hidden, experts, top_k, bias_device)
        self.router = ScaledRouter(hidden, experts, top_k, bias_device)
