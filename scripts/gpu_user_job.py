"""A user's own job, written as one would without the workbench: a small transformer LM, FSDP2, six AdamW steps.

Run unmodified under `workbench job DIR -- torchrun --nproc-per-node 2 scripts/gpu_user_job.py [--bug|--linger]`
(`scripts/gpu_user_job.sh` runs them on 2 GPUs). ``--bug``: a replicated scaling buffer drawn from the global RNG
after the user reseeded it for shuffling, so each rank holds its own; ``--ddp``: DDP instead of FSDP2;
``--linger``: rank 0 spends 3 s (a checkpoint) after its last step while rank 1 ends at once (the capture's hang
watcher reads the record meanwhile).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class LM(nn.Module):
    def __init__(self, vocab=512, d=256, layers=4, bug=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        scale = torch.rand(d) if bug else torch.ones(d)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, x):
        h = self.emb(x) * self.scale
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bug", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of FSDP2")
    ap.add_argument("--linger", action="store_true", help="rank 0 writes a 'checkpoint' (3 s) before the end")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    if args.bug:
        torch.seed()  # the user "reseeds" for data shuffling, before building the model
    model = LM(bug=args.bug).cuda()
    if args.ddp:  # the reducer's all-reduces are issued from C++: only Flight Recorder sees them
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    else:
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    for step in range(args.steps):
        x = torch.randint(0, 512, (8, 64), device="cuda", generator=g)
        loss = nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if args.linger and rank == 0:
        import time
        time.sleep(3.0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
