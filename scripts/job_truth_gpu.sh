#!/usr/bin/env bash
# Issue 45's GPU proof in one device call, from the repo root of a machine with N GPUs (4 here):
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/job_truth_gpu.sh
# scripts/job_truth_gpu.py runs three torchrun jobs one after another (the clean Llama-3.2-1B-shaped FSDP2 job, the
# same with a bad batch on rank 2 attached post mortem, a deadlock the ledgers prove) and leaves in $OUT:
# env_truth.txt, job_truth_<N>gpu.json/.txt and each job's torchrun log (job_truth_<part>.log).
# Device tool: run(command="WB_COMMIT=... bash scripts/job_truth_gpu.sh", carry=[".whl"], kind="nvidia-h100-x4").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi -L 2>/dev/null
  $PY -c "import sys, torch, transformers, ipyparallel; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), \
'transformers', transformers.__version__, 'ipyparallel', ipyparallel.__version__, 'main', '${WB_COMMIT:-}')"
} 2>&1 | tee "$OUT/env_truth.txt"
t0=$(date +%s)
timeout -k 20 "${LIMIT:-560}" $PY scripts/job_truth_gpu.py --out "$OUT" ${PARTS:+--parts "$PARTS"} ${EXTRA:-}
rc=$?
echo "job_truth: $(( $(date +%s) - t0 ))s, rc=$rc"
ps -eo pid,args | grep -E "wb-job-truth|job_truth_gpu" | grep -v grep || echo "no process left"
exit $rc
