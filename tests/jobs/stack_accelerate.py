"""A user's own Accelerate script: a tiny Llama built on meta, materialised, loaded, ``prepare``d; CPU, gloo.

    torchrun --standalone --nproc-per-node 2 tests/jobs/stack_accelerate.py [--forget-inv-freq]

No line of the workbench in it. The model is built under ``init_empty_weights(include_buffers=True)``, given memory
with ``to_empty`` and filled from a checkpoint (here one every rank makes alike from seed 0). A checkpoint holds no
non-persistent buffer, so the script recomputes the rotary ``inv_freq`` itself; ``--forget-inv-freq`` plants the
bug of leaving it out: ``inv_freq`` keeps whatever memory ``to_empty`` handed out. (On CPU Accelerate wraps the
model in DDP; its FSDP plugin is used on GPUs only.)
"""

import argparse

import torch
from accelerate import Accelerator, init_empty_weights
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forget-inv-freq", action="store_true", help="plant the bug: inv_freq never written")
    args = ap.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    checkpoint = LlamaForCausalLM(config).state_dict()
    with init_empty_weights(include_buffers=True):
        model = LlamaForCausalLM(config)
    model.to_empty(device=accelerator.device)
    model.load_state_dict(checkpoint)
    if not args.forget_inv_freq:
        rotary = model.model.rotary_emb
        inv_freq, _ = rotary.compute_default_rope_parameters(config)
        rotary.inv_freq.copy_(inv_freq)
        rotary.original_inv_freq.copy_(inv_freq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.arange(32).reshape(2, 16) % config.vocab_size
    for step in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step} loss {loss.item():.6f}")
    accelerator.wait_for_everyone()  # no rank tears the group down while a peer is still in it
    accelerator.end_training()


if __name__ == "__main__":
    main()
