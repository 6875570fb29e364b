"""An HF ``Trainer`` job on a tiny Llama config, no line of the workbench in it (two CPU ranks, gloo).

    workbench job runs/trainer -- python -m torch.distributed.run --nproc-per-node 2 tests/jobs/hf_trainer.py

``Trainer`` wraps the model in DDP through accelerate's ``prepare`` and steps AdamW three times.
"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        ids = (torch.arange(8) * (i + 1)) % 64
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="trainer-"), max_steps=3, per_device_train_batch_size=2,
                             use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", logging_steps=1,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
    result = Trainer(model=model, args=args, train_dataset=Tokens()).train()
    if args.process_index == 0:
        print(f"trained {result.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
