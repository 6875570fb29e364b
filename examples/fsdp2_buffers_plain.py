"""``fsdp2_buffers_job.py`` with no line of the workbench: the same job, captured from outside.

    workbench job runs/fsdp2 -- python -m torch.distributed.run --nproc-per-node 2 examples/fsdp2_buffers_plain.py
    workbench report runs/fsdp2

Every rank builds the model on meta, wraps it with ``fully_shard``, materialises it with
``to_empty`` and loads the weights with ``set_model_state_dict(full_state_dict=True,
broadcast_from_rank0=True)``; the rotary ``inv_freq`` (non-persistent: no state dict carries it) is
then broadcast from rank 0, which never initialised it either. The automatic points (after
``fully_shard``, ``to_empty``, ``set_model_state_dict`` and the first forward) read the same story
as the manual ones of ``fsdp2_buffers_job.py``. ``--fix`` recomputes the buffers on rank 0 first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from workbench.lab.buffers import recompute_rope, sync_non_persistent_buffers
from workbench.lab.models import load_pretrained, qwen3_config, save_checkpoint, token_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fix", action="store_true", help="rank 0 recomputes inv_freq before the broadcast")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
    config = qwen3_config()
    tmp = tempfile.mkdtemp(prefix=f"fsdp2-job-r{rank}-")  # this rank's tiny checkpoint; removed at the end
    ckpt = save_checkpoint(config, tmp, seed=0)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager").eval()

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    model.to_empty(device=device)

    full_sd = {}
    if rank == 0:
        full_sd = {k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    if args.fix and rank == 0:
        recompute_rope(model)
    sync_non_persistent_buffers(model, device)

    ids = token_batch(config.vocab_size, 16, 0, device)
    reference = load_pretrained(ckpt, torch.bfloat16, device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        expected = reference(input_ids=ids).logits.float()
    diff = (logits - expected).abs().nan_to_num(nan=float("inf")).max().item()
    print(f"rank {rank}: logits differ from the reference by {diff}", flush=True)

    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
