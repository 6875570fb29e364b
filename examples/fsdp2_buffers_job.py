"""An FSDP2 init job with the non-persistent-buffer bug (SkyRL's ``fsdp2_load_full_state_dict``),
run under torchrun with the workbench capturing at each phase.

    python -m torch.distributed.run --nproc-per-node 2 examples/fsdp2_buffers_job.py runs/fsdp2
    workbench report runs/fsdp2

Every rank builds the model on meta, wraps it with ``fully_shard``, materialises it with
``to_empty`` and loads the weights with ``set_model_state_dict(full_state_dict=True,
broadcast_from_rank0=True)``. The rotary ``inv_freq`` is a non-persistent buffer: no state dict
carries it, and the ``_sync_non_persistent_buffers`` step broadcasts rank 0's copy, which was never
initialised either. The same code as the catalogue's ``fsdp2-nonpersistent-buffer-sync`` scenario,
written as a user's script: ``--fix`` recomputes the buffers on rank 0 before the broadcast.
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

import workbench.job as wj
from workbench.lab.buffers import recompute_rope, sync_non_persistent_buffers
from workbench.lab.models import load_pretrained, qwen3_config, save_checkpoint, token_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="the capture directory (one shard per rank)")
    ap.add_argument("--fix", action="store_true", help="rank 0 recomputes inv_freq before the broadcast")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    cap = wj.capture(args.out)
    rank, device = dist.get_rank(), torch.device("cpu")
    config = qwen3_config()
    tmp = tempfile.mkdtemp(prefix=f"fsdp2-job-r{rank}-")  # this rank's tiny checkpoint; removed at the end
    ckpt = save_checkpoint(config, tmp, seed=0)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager").eval()
    cap.point("load", model=model)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cap.point("shard", model=model)

    model.to_empty(device=device)
    cap.point("materialize", model=model)

    full_sd = {}
    if rank == 0:
        full_sd = {k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    cap.point("load_state_dict", model=model)

    if args.fix and rank == 0:
        recompute_rope(model)
    sync_non_persistent_buffers(model, device)
    cap.point("sync_buffers", model=model)

    ids = token_batch(config.vocab_size, 16, 0, device)
    reference = load_pretrained(ckpt, torch.bfloat16, device)
    with torch.no_grad():
        with cap.trace(model):
            logits = model(input_ids=ids).logits.float()
        with cap.trace(reference, run="reference"):
            expected = reference(input_ids=ids).logits.float()
    diff = (logits - expected).abs().nan_to_num(nan=float("inf")).max().item()
    cap.output("logits", logits, ref_max_abs_diff=diff)
    cap.point("forward", model=model)

    cap.close()
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
