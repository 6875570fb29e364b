"""A training script written for accelerate (``Accelerator().prepare``), no line of the workbench in it.

    workbench job runs/acc -- accelerate launch --multi_gpu --num_processes 2 tests/jobs/accelerate_prepare.py

Every rank trains a tiny MLP on the same batch for four steps: a clean job.
"""

import torch
from accelerate import Accelerator
from torch import nn


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = torch.linspace(-1, 1, 32).reshape(4, 8)
    for step in range(4):
        loss = model(batch).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.is_main_process:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
