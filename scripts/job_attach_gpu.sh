#!/usr/bin/env bash
# Issue 37's GPU proof in one device call, from the repo root of a machine with N GPUs (4 here):
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/job_attach_gpu.sh
# torchrun --nproc-per-node N of the Qwen3-1.7B-shaped FSDP2 job (scripts/job_attach_gpu.py), REPEAT (3) times
# one after another: a client on the same machine attaches at cap.breakpoint(), probes the model twice, changes
# it, resumes; timed. Leaves in $OUT: env.txt, job_attach_<N>gpu.json/.txt, job_attach_<N>gpu_run<i>.log.
# Device tool: run(command="WB_COMMIT=... bash scripts/job_attach_gpu.sh", carry=[".whl"], kind="nvidia-h100-x4").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export WB_COMMIT=${WB_COMMIT:-}
{
  nvidia-smi -L 2>/dev/null
  $PY -c "import torch, transformers, ipyparallel; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__, \
'ipyparallel', ipyparallel.__version__, 'main', '$WB_COMMIT')"
} 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
timeout -k 20 "${LIMIT:-500}" $PY scripts/job_attach_gpu.py --shape "${SHAPE:-qwen3-1.7b}" --repeat "${REPEAT:-3}" \
  --out "$OUT"
rc=$?
echo "attach runs $(( $(date +%s) - t0 ))s, rc=$rc"
ps -eo pid,args | grep wb-job-attach- | grep -v grep || echo "no process left"
exit $rc
