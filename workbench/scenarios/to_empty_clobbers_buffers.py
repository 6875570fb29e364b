"""to-empty-clobbers-buffers: materialising a meta model wipes a buffer that was never on meta.

Incident 001 (Megatron-FSDP, MoE router with ``--moe-router-enable-expert-bias``). The
router registers ``expert_bias`` with an explicit ``device=``, so inside
``with torch.device("meta")`` it escapes the meta context and starts as real zeros.
Materialisation then walks the modules with ``m.to_empty(device, recurse=False)`` and
``m.reset_parameters()``. ``to_empty`` replaces *every* tensor of the module, meta or
not, with uninitialised memory, and ``reset_parameters`` re-initialises parameters only:
``expert_bias`` keeps whatever memory it got (NaN under poison, stale bytes without).

The bias is added to the router scores before top-k (aux-loss-free load balancing), so a
NaN or garbage bias decides where every token goes: the expert load collapses onto the
experts whose garbage is largest (with all-NaN, the ones ``topk`` happens to return).
The gating weights come from the unbiased scores, so the output stays finite and
nothing crashes: only the load shows it. Training does not heal it (step ``train``): the
balancing update adds to the bias each step, and NaN plus anything is NaN, so the bias the
report found stays NaN for the whole run while the load stays collapsed.

Fix ``materialize-meta-only`` (the upstream one): materialise only tensors that are on
meta, through ``Module._apply`` with an ``is_meta`` guard, leaving real buffers alone.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from workbench.scenario import Scenario

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch and the rank helpers (the toy MoE model included) are imported inside the steps, which run on
# the ranks: the client imports this module only for its declaration (tests/test_client_imports.py).

SCENARIO = Scenario(
    name="to-empty-clobbers-buffers",
    title="to_empty(recurse=False) clobbers an MoE router's expert_bias that was never on meta",
    doc=__doc__,
    params={"hidden": 64, "experts": 8, "top_k": 2, "tokens": 256, "vocab_size": 512, "seed": 0,
            "train_steps": 3, "bias_update_rate": 0.001},
    probe=["model"],
    incident="001_446ac3c011ddf647",
)
META_ONLY = SCENARIO.fix(
    "materialize-meta-only",
    "Materialise only tensors that are on meta (Module._apply with an is_meta guard); "
    "expert_bias keeps its zeros.",
)


@SCENARIO.step
def build(ctx) -> None:
    """Build on meta; the router's expert_bias is created on the rank's device (zeros)."""
    import torch

    from workbench.lab.toy_moe import TinyMoE

    p = ctx.params
    with torch.device("meta"):
        ctx.model = TinyMoE(p["vocab_size"], p["hidden"], p["experts"], p["top_k"], ctx.device)
    ctx.note(f"expert_bias on {ctx.model.router.expert_bias.device}: real zeros; everything else on meta")


@SCENARIO.step
def materialize(ctx) -> None:
    """Per module: to_empty(recurse=False) then reset_parameters (the fix: meta tensors only)."""
    import torch

    torch.manual_seed(ctx.params["seed"])  # same weights on every rank, as a seeded init gives
    for module in ctx.model.modules():
        if ctx.fix == META_ONLY:
            materialize_meta_only(module, ctx.device, poison=ctx.poison)
        else:
            module.to_empty(device=ctx.device, recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    ctx.note("expert_bias left alone" if ctx.fix == META_ONLY else "to_empty replaced expert_bias too")


@SCENARIO.step
def route(ctx) -> None:
    """Route one batch (the same on every rank), traced, next to a reference with the zero bias."""
    import torch.distributed as dist

    from workbench.lab.toy_moe import route_beside_reference

    reference = copy.deepcopy(ctx.model)
    reference.router.expert_bias.zero_()  # the value the router was created with
    hidden, _, load, expected = route_beside_reference(ctx, ctx.model, reference)
    ctx.output("expert_load", load, ref_max_abs_diff=float((load - expected).abs().max()))
    total = load.clone()
    dist.all_reduce(total)  # what aux-loss-free balancing would update the bias from
    ctx.output("global_expert_load", total)
    ctx.output("hidden", hidden)
    ctx.note(f"tokens per expert: {load.tolist()} (reference {expected.tolist()})")


@SCENARIO.step
def train(ctx) -> None:
    """Training steps of aux-loss-free balancing: each adds to expert_bias from the global load, here
    and in a reference whose bias started at the zeros it was created with."""
    import torch
    import torch.distributed as dist

    from workbench.lab.toy_moe import update_expert_bias

    p = ctx.params
    g = torch.Generator().manual_seed(p["seed"] + 1)
    reference = copy.deepcopy(ctx.model)
    reference.router.expert_bias.zero_()
    for _ in range(p["train_steps"]):
        ids = torch.randint(0, p["vocab_size"], (p["tokens"],), generator=g).to(ctx.device)
        loads = []
        for model in (ctx.model, reference):
            with torch.no_grad():
                _, chosen = model(ids)
            load = torch.bincount(chosen.reshape(-1), minlength=p["experts"]).float()
            dist.all_reduce(load)
            update_expert_bias(model.router, load, p["bias_update_rate"])
            loads.append(load)
    bias = ctx.model.router.expert_bias
    ctx.output("expert_bias_after_training", bias.clone(),
               ref_max_abs_diff=float((bias - reference.router.expert_bias).abs().nan_to_num(nan=float("inf")).max()))
    ctx.output("global_expert_load", loads[0], ref_max_abs_diff=float((loads[0] - loads[1]).abs().max()))
    ctx.note(f"after {p['train_steps']} balancing update(s): expert_bias has {int(torch.isnan(bias).sum())} NaN "
             f"of {bias.numel()}; global load {loads[0].long().tolist()} (reference {loads[1].long().tolist()})")


def materialize_meta_only(module: nn.Module, device: torch.device, poison: bool = False) -> None:
    """``to_empty(recurse=False)`` for meta tensors only: real tensors keep their values.

    ``poison`` fills the fresh memory like the workbench's ``to_empty`` does, so a tensor
    this path hands out and nobody writes still shows up as never written.
    """
    import torch

    from workbench.rank.poison import poison_

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        new = torch.empty_like(t, device=device)
        return poison_(new) if poison else new

    module._apply(fresh, recurse=False)
