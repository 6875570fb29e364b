"""A toy MoE block whose router keeps a load-balancing bias created on a real device.

As in Megatron, ``expert_bias`` is registered with an explicit device, so it is real even
when the module is built under ``with torch.device("meta")``; the to-empty-clobbers-buffers
scenario builds it that way. Here, not in the scenario file, because the client imports a
scenario's module for its declaration and must not import torch to do it.
"""

from __future__ import annotations

import torch
from torch import nn


class Router(nn.Module):
    """Sigmoid top-k router with a load-balancing bias used for expert selection only."""

    def __init__(self, hidden: int, experts: int, top_k: int, bias_device: torch.device):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        # As in Megatron: an explicit device, so the buffer is real even under a meta context.
        self.register_buffer("expert_bias", torch.zeros(experts, device=bias_device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)  # parameters only: the bias is not touched

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(x @ self.weight.t())
        # a stable sort, not topk: over NaN (a never-written bias) or tied scores, topk's picks are each CPU
        # kernel's own choice, and a colleague's rerun would route elsewhere; here ties go to the lower id
        ranked = torch.sort(scores + self.expert_bias, dim=-1, descending=True, stable=True).indices
        chosen = ranked[..., : self.top_k]
        gates = scores.gather(-1, chosen)
        return chosen, gates / gates.sum(-1, keepdim=True)


@torch.no_grad()
def update_expert_bias(router: Router, global_load: torch.Tensor, rate: float) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3, Megatron's ``--moe-router-enable-expert-bias``):
    raise the bias of under-loaded experts, lower it for over-loaded ones, by ``rate`` a step.

    An update adds to the bias, it never overwrites it: a NaN bias stays NaN for every step of
    training, which is why the incident's bias never recovered on its own.
    """
    load = global_load.to(router.expert_bias.dtype)
    router.expert_bias.add_(rate * torch.sign(load.mean() - load))


class TinyMoE(nn.Module):
    def __init__(self, vocab: int, hidden: int, experts: int, top_k: int, bias_device: torch.device):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.router = Router(hidden, experts, top_k, bias_device)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(ids)
        chosen, gates = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, gates[tok, slot, None] * expert(x[tok]))
        return out, chosen


def route_beside_reference(ctx, model: TinyMoE, reference: TinyMoE) -> tuple[torch.Tensor, ...]:
    """One batch (the same on every rank: ``ctx.params``' seed, tokens and vocab size) through ``model``
    and ``reference``, each traced (the reference as run ``"reference"``): (hidden, reference hidden,
    tokens per expert, the reference's tokens per expert)."""
    from workbench.rank.trace import trace_forward

    p = ctx.params
    g = torch.Generator().manual_seed(p["seed"])
    ids = torch.randint(0, p["vocab_size"], (p["tokens"],), generator=g).to(ctx.device)
    with torch.no_grad():
        with trace_forward(ctx, model):
            hidden, chosen = model(ids)
        with trace_forward(ctx, reference, run="reference"):
            ref_hidden, ref_chosen = reference(ids)
    load = torch.bincount(chosen.reshape(-1), minlength=p["experts"])
    expected = torch.bincount(ref_chosen.reshape(-1), minlength=p["experts"])
    return hidden, ref_hidden, load, expected
