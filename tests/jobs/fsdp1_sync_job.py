"""The headline incident's init as a user's torchrun script (FSDP1, ``sync_module_states=True``), with manual points.

    python -m torch.distributed.run --nproc-per-node 2 tests/jobs/fsdp1_sync_job.py runs/fsdp1

Rank 0 takes ``from_pretrained(dtype=bf16)`` (``inv_freq`` stays fp32); rank 1 builds the model on meta and
casts it all to bf16. FSDP1 materialises rank 1 with ``to_empty(recurse=False)`` and broadcasts rank 0's
states, bucketed by dtype: rank 0's extra fp32 bucket lands in rank 1's bf16 one, rank 1 goes on to its
forward, rank 0 waits in its second broadcast until the group's timeout. Every line that names ``cap`` or
``wj`` is the workbench's: without them it is the same job (what ``workbench job`` captures unmodified).
"""

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import workbench.job as wj
from workbench.lab.fsdp_cpu import allow_cpu_sync_module_states  # FSDP1's sync_module_states on CPU (gloo)
from workbench.lab.models import build_on_meta, load_pretrained, qwen3_config, save_checkpoint, token_batch

ap = argparse.ArgumentParser()
ap.add_argument("out", nargs="?", help="the capture directory")
ap.add_argument("--timeout", type=float, default=20.0, help="the group's timeout (s): how long rank 0 waits")
args = ap.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
cap = wj.capture(args.out)
rank, device = dist.get_rank(), torch.device("cpu")
config = qwen3_config()
ckpt = save_checkpoint(config, os.path.join(tempfile.mkdtemp(prefix=f"fsdp1-job-r{rank}-"), "ckpt"), 0)
if rank == 0:
    model = load_pretrained(ckpt, torch.bfloat16, device)
else:
    model = build_on_meta(config)
cap.point("load", model=model)

if rank != 0:
    model.to(torch.bfloat16)
cap.point("cast", model=model)


def param_init_fn(module: torch.nn.Module) -> None:
    module.to_empty(device=device, recurse=False)


with allow_cpu_sync_module_states(device.type):
    wrapped = FSDP(model, param_init_fn=param_init_fn, sync_module_states=True, device_id=device,
                   use_orig_params=True)
cap.point("wrap_fsdp1", model=model)

ids = token_batch(config.vocab_size, 16, 0, device)
with torch.no_grad():
    logits = wrapped(input_ids=ids).logits.float()
cap.point("forward", model=model, logits=logits)
print(f"rank {rank}: {int(logits.isnan().sum())} NaN logits", flush=True)
dist.destroy_process_group()
