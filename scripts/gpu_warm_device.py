"""Where a rank's probe kernel is built and which GPUs each rank's process holds memory on, for a job whose first
CUDA call is ``torch.cuda.set_device(local_rank)`` (torchrun, 2 GPUs, NCCL). Run by ``scripts/gpu_warm_device.sh``:

    torchrun --nproc-per-node 2 scripts/gpu_warm_device.py OUT_DIR
"""

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)  # the job's first CUDA call
dist.init_process_group("nccl")
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for _step in range(4):
    loss = ddp(torch.ones(16, 256, device="cuda")).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.cuda.synchronize()
time.sleep(2)  # every rank's warm-up done by now
apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                      capture_output=True, text=True).stdout
gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                      text=True).stdout
index = {u.strip(): int(i) for i, u in (ln.split(",") for ln in gpus.strip().splitlines())}
mine = [(index.get(u.strip()), m.strip()) for p, u, m in (ln.split(",") for ln in apps.strip().splitlines())
        if int(p) == os.getpid()]
warm = None
if "workbench.rank.probe_fused" in sys.modules:
    warm = {k: v for k, v in sys.modules["workbench.rank.probe_fused"]._WARM.items() if k in ("result", "phase")}
out = {"rank": dist.get_rank(), "pid": os.getpid(), "gpus_held": mine, "warm": warm,
       "current": torch.cuda.current_device()}
print(json.dumps(out, default=str), flush=True)
with open(os.path.join(sys.argv[1], f"warm_rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f, default=str)
dist.barrier()
dist.destroy_process_group()
