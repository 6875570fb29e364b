"""A user's own transformers ``Trainer`` script: a tiny Llama built on meta, materialised, loaded, trained by the
Trainer (DDP through Accelerate); CPU, gloo.

    torchrun --standalone --nproc-per-node 2 tests/jobs/stack_trainer.py [--forget-inv-freq]

No line of the workbench in it. The Trainer owns the loop: it wraps the model in DDP, makes its own AdamW and
schedule, clips the gradients and logs the loss (averaged over the ranks); the script only prints each logged loss
on rank 0. The model is built on the meta device, given memory with ``to_empty`` and filled from a checkpoint (one
every rank makes alike from seed 0). A checkpoint holds no non-persistent buffer, so the script recomputes the
rotary ``inv_freq``; ``--forget-inv-freq`` plants the bug of leaving it out: ``inv_freq`` keeps whatever memory
``to_empty`` handed out, and a tiny random model's loss hardly shows it.
"""

import argparse
import gc
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

STEPS = 3


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step - 1} loss {logs['loss']:.6f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forget-inv-freq", action="store_true", help="plant the bug: inv_freq never written")
    args = ap.parse_args()
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    checkpoint = LlamaForCausalLM(config).state_dict()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.load_state_dict(checkpoint)
    if not args.forget_inv_freq:
        rotary = model.model.rotary_emb
        inv_freq, _ = rotary.compute_default_rope_parameters(config)
        rotary.inv_freq.copy_(inv_freq)
        rotary.original_inv_freq.copy_(inv_freq)
    training = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="stack-trainer-"), use_cpu=True,
                                 ddp_backend="gloo", ddp_find_unused_parameters=False, max_steps=STEPS,
                                 per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                                 save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[PrintLoss()])
    trainer.remove_callback(PrinterCallback)  # its log dicts carry the run's timings: stdout would differ per run
    trainer.train()
    del trainer, model  # the Trainer's DDP model holds the group: let it go before the group is destroyed
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
