"""The headline incident as a user's own job: FSDP1 ``sync_module_states`` with rank 0 loaded by
``from_pretrained`` and the other ranks built on meta, run under torchrun with the workbench capturing.

    python -m torch.distributed.run --nproc-per-node 2 examples/fsdp1_rotary_job.py runs/fp32 --dtypes fp32
    python -m torch.distributed.run --nproc-per-node 2 examples/fsdp1_rotary_job.py runs/bf16
    workbench diff runs/fp32 runs/bf16

``--dtypes bf16`` (the default, the incident): rank 0 takes ``from_pretrained(dtype=bf16)``, which keeps
the non-persistent ``rotary_emb.inv_freq`` fp32; the other ranks cast their meta-built model to bf16, the
buffer included. FSDP1's ``_broadcast_coalesced`` buckets by dtype, so rank 0 sends an fp32 bucket (256 B)
then a bf16 one while rank 1 posts a single bf16 bucket: on gloo rank 1 takes rank 0's fp32 bytes into
its bf16 tensors and rank 0 then times out in its second send (``--timeout`` seconds; the job fails).
``--dtypes fp32`` (the incident's workaround): every rank stays fp32, one bucket, the job ends clean.
The same code as the catalogue's ``fsdp1-rotary-meta-init`` scenario (its ``fp32-everywhere`` fix).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

import workbench.job as wj
from workbench.lab.fsdp_cpu import allow_cpu_sync_module_states
from workbench.lab.models import build_on_meta, load_pretrained, qwen3_config, save_checkpoint, token_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="the capture directory (one shard per rank)")
    ap.add_argument("--dtypes", choices=("bf16", "fp32"), default="bf16", help="the model's dtype")
    ap.add_argument("--timeout", type=float, default=4.0, help="the group's timeout (s): a mispaired send ends")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    cap = wj.capture(args.out, points=["load", "cast", "wrap", "forward"])
    rank, device = dist.get_rank(), torch.device("cpu")
    dtype = torch.bfloat16 if args.dtypes == "bf16" else torch.float32
    config = qwen3_config()
    tmp = tempfile.mkdtemp(prefix=f"fsdp1-job-r{rank}-")  # this rank's tiny checkpoint; removed at the end
    try:
        ckpt = save_checkpoint(config, tmp, seed=0)
        model = load_pretrained(ckpt, dtype, device) if rank == 0 else build_on_meta(config)
        cap.point("load", model=model)

        if rank != 0:
            model.to(dtype)  # the whole module, non-persistent buffers included
        cap.point("cast", model=model)

        with allow_cpu_sync_module_states(device.type):
            wrapped = FSDP(model, param_init_fn=lambda m: m.to_empty(device=device, recurse=False),
                           sync_module_states=True, device_id=device,
                           sharding_strategy=ShardingStrategy.NO_SHARD, use_orig_params=True)
        cap.point("wrap", model=model)

        ids = token_batch(config.vocab_size, 16, 0, device)
        with torch.no_grad():
            logits = wrapped(input_ids=ids).logits.float()
        cap.output("logits", logits)
        cap.point("forward", model=model)
        cap.close()
        dist.destroy_process_group()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
