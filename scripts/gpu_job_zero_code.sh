#!/usr/bin/env bash
# Issue 47's GPU proof in one device call, from the repo root of a machine with N GPUs (4 here):
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_job_zero_code.sh
# The Llama-3.2-1B-shaped FSDP2 job (scripts/gpu_job_zero_code.py), unmodified, REPEAT (2) times each way: plain
# torchrun, `workbench job DIR -- torchrun ...` (defaults) and `--every 1`; each capture read by `workbench report`.
# Leaves in $OUT: env.txt, job_zero_code_<N>gpu.json/.txt, every run's log, capture and HTML report.
# Device tool: run(command="WB_COMMIT=... bash scripts/gpu_job_zero_code.sh", carry=[".whl"], kind="nvidia-h100-x4").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export WB_COMMIT=${WB_COMMIT:-}
{
  nvidia-smi -L 2>/dev/null
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__, 'main', '$WB_COMMIT')"
} 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
timeout -k 20 "${LIMIT:-560}" $PY scripts/gpu_job_zero_code.py --shape "${SHAPE:-llama-3.2-1b}" \
  --repeat "${REPEAT:-2}" --steps "${STEPS:-6}" --out "$OUT"
rc=$?
echo "zero-code runs $(( $(date +%s) - t0 ))s, rc=$rc"
exit $rc
