#!/usr/bin/env bash
# The Lightning Trainer started by its own launcher (`python train.py`, devices=2, no torchrun) under `workbench job`
# on 2 GPUs, NCCL: plain and under the workbench, right and with the clip under is_global_zero
# (tests/jobs/stack_pl_trainer.py --gpu). One device call, kind nvidia-h200-x2, carry [".whl"] (fetched with
# ../shared/tools/gpu-wheels.sh pytorch-lightning==2.6.6 torchmetrics==1.9.0 lightning-utilities==0.15.3).
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_pl_selflaunch.sh
# Leaves in $OUT: env.txt, pl_selflaunch_2gpu.json (fixtures/gpu/, re-read by tests/test_gpu_recordings.py), the logs.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
record_env
timeout -k 10 560 $PY scripts/gpu_pl_selflaunch.py "$OUT"
