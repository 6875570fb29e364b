#!/usr/bin/env bash
# Where each rank's probe kernel is built, and which GPUs each rank's process holds memory on, for a job whose first
# CUDA call is torch.cuda.set_device(local_rank): plain, then under `workbench job` (2 GPUs, NCCL; one device call,
# kind nvidia-h200-x2, carry [".whl"]).  WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_warm_device.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
record_env
for way in plain job; do
  mkdir -p "$OUT/$way"
  if [ $way = plain ]; then
    timeout -k 10 200 $PY -m torch.distributed.run --nproc-per-node 2 scripts/gpu_warm_device.py "$OUT/$way" 2>&1 | tail -4
  else
    timeout -k 10 200 $PY -m workbench.cli job "$OUT/cap" -- $PY -m torch.distributed.run --nproc-per-node 2 \
      scripts/gpu_warm_device.py "$OUT/$way" 2>&1 | tail -6
  fi
done
rm -rf "$OUT/cap"
