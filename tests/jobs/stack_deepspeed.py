"""A user's own DeepSpeed script: ZeRO-3 with ``zero.Init``, a tiny Llama, CPU, gloo.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 tests/jobs/stack_deepspeed.py [--unwritten-buffer]

No line of the workbench in it. Right as it stands. ``--unwritten-buffer`` plants the init-path bug of a model built
inside ``zero.Init``: the model's own buffer (a per-token logit scale) is made with ``torch.empty`` and never filled,
so its values are whatever memory it was handed (ZeRO partitions parameters; buffers stay whole on every rank).

On CPU DeepSpeed's communication backend builds its shared-memory all-reduce (``deepspeed_shm_comm``) with a C++
compiler on first use (99 s on a 2-core box, then cached). This script turns that op off before DeepSpeed's first
collective, so DeepSpeed talks plain gloo (docs/stacks.md).
"""

import argparse
import logging
import warnings

import deepspeed
import deepspeed.ops
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 3


class ScaledLM(nn.Module):
    """A causal LM whose logits are scaled per token by a buffer (ones when right)."""

    def __init__(self, config: LlamaConfig, unwritten: bool) -> None:
        super().__init__()
        self.lm = LlamaForCausalLM(config)
        self.register_buffer("logit_scale", torch.empty(config.vocab_size))
        if not unwritten:
            self.logit_scale.fill_(1.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids).logits * self.logit_scale
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unwritten-buffer", action="store_true", help="plant the bug: a buffer never written")
    ap.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's argument
    args = ap.parse_args()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch on DeepSpeed's collectives, at every call
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo: no JIT build of the shm op
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = ScaledLM(llama, args.unwritten_buffer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.arange(16).reshape(1, 16) % llama.vocab_size
    for step in range(STEPS):
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
