"""The model both roles hold, and what a trainer rank exports from it.

A tiny real ``DeepseekV3ForCausalLM`` (one MoE layer, 8 routed experts, top-2, eager
attention) whose router carries ``mlp.gate.e_score_correction_bias``: an fp32 buffer added
to ``sigmoid(router logits)`` before top-k, so it decides which experts a token visits
but not how much they weigh.

Expert parallelism decides what a trainer rank exports: rank ``r`` of ``world`` owns
routed experts ``r*E_loc .. (r+1)*E_loc - 1`` (``E_loc = n_experts / world``) and exports
them under their global HF names, expert tensors first (SkyRL buckets grouped expert tasks
first), then the dense tensors every rank holds. So names and order differ per rank while
the byte sizes agree: exactly the layout on which one rank's slicing metadata applied to
another rank's buffer raises nothing. ``layout="replicated"`` is the control: every rank
exports every tensor in one order (an FSDP ``full_tensor()`` export, or PP=2 in the incident).

transformers fuses a layer's experts into ``experts.gate_up_proj`` / ``experts.down_proj``
(``[E, ...]``); the HF names here are per expert (``experts.5.gate_up_proj``), views into
the fused tensor, as an exporter yields and a loader consumes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from workbench.errors import WorkbenchError
from workbench.lab.weightsync.defaults import TINY, VLLM_SHAPE

BIAS_SUFFIX = "e_score_correction_bias"
EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>gate_up_proj|down_proj)$")
FUSED = (".experts.gate_up_proj", ".experts.down_proj")
LAYOUTS = ("ep", "replicated")


def tiny_config(**shape: Any):
    """A tiny ``DeepseekV3Config``; keys of ``TINY`` in ``shape`` override (others are ignored)."""
    from transformers import DeepseekV3Config

    kw = {**TINY, **{k: v for k, v in shape.items() if k in TINY}}
    return DeepseekV3Config(q_lora_rank=None, n_group=1, topk_group=1, tie_word_embeddings=False,
                            attn_implementation="eager", **kw)


def vllm_config(**shape: Any):
    """A tiny ``Glm4MoeConfig`` (``VLLM_SHAPE``): the model vLLM's CPU build serves for ``receiver=vllm``.

    Same routing as DeepseekV3 (``topk(sigmoid(logits) + e_score_correction_bias)``, routed and
    shared experts, fused ``experts.gate_up_proj`` in transformers); plain attention with head_dim 64.
    ``shape`` keys other than ``VLLM_SHAPE``'s are ignored (the DeepseekV3 shape of the stand-in)."""
    from transformers import Glm4MoeConfig

    kw = {**VLLM_SHAPE, **{k: v for k, v in shape.items() if k in VLLM_SHAPE and k in _VLLM_FREE}}
    return Glm4MoeConfig(n_group=1, topk_group=1, tie_word_embeddings=False, attn_implementation="eager", **kw)


_VLLM_FREE = ("vocab_size", "initializer_range")  # shape keys a vLLM run still takes from the user


def build_model(config, seed: int, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                bias_offset: float = 41.0, bias_std: float = 7e-4, router_scale: float = 1.0) -> nn.Module:
    """A seeded model in ``dtype`` with the router bias kept fp32 (as Megatron keeps ``expert_bias``).

    Each MoE layer's bias is ``bias_offset + 4*layer + N(0, bias_std)`` per expert (the
    reported shape: offsets of 25-57, per-expert std ~7e-4). ``router_scale`` multiplies the
    router weight: small values squeeze ``sigmoid(logits)`` towards 0.5, so per-expert bias
    differences of ~1e-3 decide some top-k picks.
    """
    glm = config.model_type != "deepseek_v3"
    if glm:
        from transformers import Glm4MoeForCausalLM as cls
    else:
        from transformers import DeepseekV3ForCausalLM as cls

    torch.manual_seed(seed)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms start at ones: perturb them so every tensor's bytes are its own
                p += 0.05 * torch.randn(p.shape, generator=g)
            if name.endswith(".gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * config.initializer_range * router_scale)
    rope = {n: b.clone() for n, b in model.named_buffers() if glm and "rotary_emb" in n}
    model = model.to(device=device, dtype=dtype)
    for name, b in rope.items():  # as from_pretrained leaves them (vLLM computes its rope in fp32 too)
        model.get_buffer(name).data = b.to(device)
    for i, (_, b) in enumerate(router_biases(model)):
        b.data = (bias_offset + 4.0 * i + bias_std * torch.randn(b.shape, generator=g)).to(device, torch.float32)
    return model


@torch.no_grad()
def training_step(model: nn.Module, seed: int, lr: float = 0.01, bias_step: float = 1e-3) -> nn.Module:
    """Stand-in for an optimizer step, in place: each weight moves by ``lr`` of its own scale,
    each router bias entry by +-``bias_step`` (aux-loss-free balancing's update). Seeded."""
    g = torch.Generator().manual_seed(seed + 11)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=g) * lr * float(p.float().std().clamp(min=1e-3))
        p += noise.to(p.device, p.dtype)
    for _, b in router_biases(model):
        b += (bias_step * torch.sign(torch.randn(b.shape, generator=g))).to(b.device, b.dtype)
    return model


def router_biases(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in model.named_buffers() if n.endswith(BIAS_SUFFIX)]


def num_experts(model: nn.Module) -> int:
    return int(model.config.n_routed_experts)


def owned_experts(n_experts: int, rank: int, world: int) -> range:
    """The routed experts trainer rank ``rank`` owns under expert parallelism."""
    if n_experts % world:
        raise WorkbenchError(f"{n_experts} routed experts do not split over {world} expert-parallel ranks")
    per = n_experts // world
    return range(rank * per, (rank + 1) * per)


def _raw(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters in model order, each router bias right after its gate weight."""
    biases = dict(router_biases(model))
    out: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        out.append((name, p))
        bias = name[: -len("weight")] + BIAS_SUFFIX
        if name.endswith(".gate.weight") and bias in biases:
            out.append((bias, biases[bias]))
    return out


def export_hf_weights(model: nn.Module, rank: int = 0, world: int = 1,
                      layout: str = "ep") -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` this trainer rank exports, in its order (tensors are views, native dtype).

    ``ep``: this rank's experts first (per MoE layer, per expert: gate_up, down), then every
    dense tensor. ``replicated``: every expert, then every dense tensor, the same on every rank.
    """
    if layout not in LAYOUTS:
        raise WorkbenchError(f"unknown export layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    raw = _raw(model)
    experts = range(num_experts(model)) if layout == "replicated" else owned_experts(num_experts(model), rank, world)
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in raw:
        if name.endswith(FUSED):
            prefix, w = name.rsplit(".", 1)
            fused.setdefault(prefix, {})[w] = t
    for prefix, ws in fused.items():
        for e in experts:
            for w in ("gate_up_proj", "down_proj"):
                yield f"{prefix}.{e}.{w}", ws[w].detach()[e]
    for name, t in raw:
        if not name.endswith(FUSED):
            yield name, t.detach()


def hf_state(model: nn.Module, layout: str = "replicated", rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """Name -> tensor (views) of what ``export_hf_weights`` yields; the default: the whole model."""
    return dict(export_hf_weights(model, rank, world, layout))


def _target(model: nn.Module, name: str) -> torch.Tensor:
    m = EXPERT_RE.match(name)
    try:
        if m:
            return model.get_parameter(f"{m['prefix']}.{m['w']}").data[int(m["e"])]
        try:
            return model.get_parameter(name).data
        except AttributeError:
            return model.get_buffer(name)
    except (AttributeError, IndexError):
        raise WorkbenchError(f"the receiver's model has no tensor {name!r}") from None


def load_hf_weight(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """vLLM's ``load_weights`` for one tensor: copy by name, cast to the model's dtype for it."""
    target = _target(model, name)
    if tuple(target.shape) != tuple(tensor.shape):
        raise WorkbenchError(f"tensor {name!r}: received shape {list(tensor.shape)}, the model holds "
                             f"{list(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def loaded_view(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Name -> the model's tensor now stored under that HF name (views: they follow later loads)."""
    return {n: _target(model, n) for n in names}


# -- what the check runs ------------------------------------------------------------------
def fixed_tokens(config, n: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randint(1, config.vocab_size, (1, n), generator=g).to(device)


@torch.no_grad()
def token_logprobs(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next fixed token (fp32, on CPU): SkyRL's round-trip quantity."""
    logits = model(tokens).logits.float()
    lp = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return lp.reshape(-1).cpu()


def topk_experts(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """DeepseekV3's pick: ``topk(sigmoid(logits) + bias)``; sorted expert ids per token."""
    return torch.topk(scores.float() + bias.float(), k, dim=-1).indices.sort(-1).values


@torch.no_grad()
def router_inputs(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per MoE layer (router name): ``sigmoid(router logits)`` of each token (fp32, CPU)."""
    out: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if hasattr(mod, BIAS_SUFFIX):
            def grab(m, args, _out, name=name):
                x = args[0].reshape(-1, m.weight.shape[1]).float()
                out[name] = torch.sigmoid(x @ m.weight.float().t()).cpu()
            hooks.append(mod.register_forward_hook(grab))
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return out


def expert_sets(scores: dict[str, torch.Tensor], biases: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Per router: each token's sorted top-k expert ids under the given biases."""
    return {r: topk_experts(s, biases[r].cpu(), k) for r, s in scores.items()}


def changed_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of tokens whose expert set differs between two ``[tokens, k]`` sorted id tables."""
    return float((a != b).any(-1).float().mean())


def distinct_values(t: torch.Tensor) -> int:
    return int(torch.unique(t.detach().float().cpu()).numel())
