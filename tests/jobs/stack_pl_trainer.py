"""A user's own Lightning Trainer script: a ``LightningModule`` around a tiny Llama, DDP on CPU (gloo), started by
Lightning's own launcher.

    python tests/jobs/stack_pl_trainer.py [--clip-on-zero] [--gpu]

No line of the workbench in it, and no torchrun: ``Trainer(devices=2)`` starts rank 1 itself and hands each rank to
``init_process_group``. Right as it stands. ``--clip-on-zero`` plants a rank-0-only guard's bug: the gradient clip
sits under ``is_global_zero`` with the log line it was written for, so rank 0 steps with clipped gradients and rank
1 with whole ones, and the DDP replicas part at the first step. ``--gpu``: two GPUs, NCCL
(``scripts/gpu_pl_selflaunch.sh``).
"""

import sys
import warnings

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 4


class TinyLM(pl.LightningModule):
    def __init__(self, clip_on_zero: bool) -> None:
        super().__init__()
        self.clip_on_zero = clip_on_zero
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, index):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        if self.trainer.is_global_zero:
            print(f"step {self.global_step} loss {loss.item():.6f}", flush=True)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.clip_on_zero and self.trainer.is_global_zero:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), 0.01)
            print(f"grad norm {norm.item():.4f}", flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    warnings.filterwarnings("ignore")  # Lightning's notes on CPU and workers; the losses are the output
    pl.seed_everything(0, verbose=False)
    data = DataLoader(TensorDataset(torch.randint(0, 128, (64, 16))), batch_size=4)
    trainer = pl.Trainer(accelerator="gpu" if "--gpu" in sys.argv else "cpu", devices=2, strategy="ddp",
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(TinyLM("--clip-on-zero" in sys.argv), data)


if __name__ == "__main__":
    main()
