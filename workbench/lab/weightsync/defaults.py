"""The weight sync's declared defaults: the tiny model shapes and the byte sizes, without torch.

Scenario declarations put these in their parameters, and the client reads a declaration
without importing torch; ``model``, ``pack``, ``conversion`` and ``broadcast`` re-export them.
"""

from __future__ import annotations

from typing import Any

TINY: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
    "num_hidden_layers": 1, "first_k_dense_replace": 0, "num_attention_heads": 2, "num_key_value_heads": 2,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "n_shared_experts": 1, "max_position_embeddings": 64,
    "initializer_range": 0.2,  # 10x the default: peaky enough logits that wrong weights show in log-probs
}
# Part 1's tiny DeepseekV3 with a dense layer in front: two layers, two pipeline stages.
TOY_SHAPE: dict[str, Any] = {**TINY, "num_hidden_layers": 2, "first_k_dense_replace": 1}
# The model under ``receiver=vllm``: a tiny GLM-4.5 MoE (vLLM's CPU attention wants head_dim 64 and has
# no MLA; its CPU MoE kernel wants the expert width a multiple of 32). Two layers as in TOY_SHAPE: a
# dense layer, then the MoE layer with the router bias; one shape for all four scenarios, so one engine
# per rank serves them all.
VLLM_SHAPE: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "max_position_embeddings": 64, "initializer_range": 0.2,
}
RECEIVERS = ("auto", "vllm", "workbench")  # the inference role: vLLM's engine, or the workbench's stand-in
DEFAULT_BUCKET_BYTES = 1 << 30  # SkyRL's default 1 GB: a tiny model is one bucket
DEFAULT_THRESHOLD = 1 << 20  # vLLM: 1 GiB; the toy models here are far below 1 MiB: one buffer
