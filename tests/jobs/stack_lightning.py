"""A user's own Lightning Fabric script: FSDP2 through ``ModelParallelStrategy``, a tiny Llama, CPU, gloo.

    torchrun --standalone --nproc-per-node 2 tests/jobs/stack_lightning.py [--empty-init]

No line of the workbench in it. Right as it stands: the model is built on CPU, then sharded. ``--empty-init``
plants Fabric's init-path bug: ``fabric.init_module(empty_init=True)`` builds on meta and materialises with
``to_empty`` and each module's ``reset_parameters()``; ``LlamaRMSNorm`` and ``LlamaRotaryEmbedding`` have none, so
their weight and ``inv_freq`` keep whatever memory ``to_empty`` handed out (Fabric only warns).
"""

import argparse
import warnings

import torch
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 3


def parallelize(model: LlamaForCausalLM, mesh) -> LlamaForCausalLM:
    dp = mesh["data_parallel"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--empty-init", action="store_true", help="plant the bug: init_module(empty_init=True)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # Fabric's and transformers' notes; the losses are the output
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with fabric.init_module(empty_init=args.empty_init):
        model = LlamaForCausalLM(config)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.arange(32).reshape(2, 16) % config.vocab_size
    for step in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
