"""A tiny Llama built on meta and materialised with ``to_empty`` on 2 gloo ranks, its weights then written by
``_init_weights`` (right), after which the script raises a ``TypeError`` of its own (a wrong call two lines later,
as a user's script does). Its only point is the automatic one at ``to_empty``: nothing after it saw the weights
written, so the raise is the story, not "never written"."""

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    dist.init_process_group("gloo")
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=64, attn_implementation="eager")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.apply(model._init_weights)
    torch.optim.AdamW(model.parameters(), lr=1e-3, betas=0.9)  # betas wants a pair: TypeError


if __name__ == "__main__":
    main()
