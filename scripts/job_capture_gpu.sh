#!/usr/bin/env bash
# Issue 46's GPU proof in one device call, from the repo root of a machine with N GPUs (4 here):
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/job_capture_gpu.sh
# benchmarks/job_capture.py under torchrun (NCCL, bf16, the Llama-3.2-1B shape, FSDP2 per layer + root, 2 x 512
# tokens a rank, a point a step, median of steps 2 to the last): the step with capture off, under the defaults and each mode
# (ledger="full", poison="all", both), and with each decoder layer compiled (inductor) off and under the defaults.
# Leaves in $OUT: env_capture.txt, job_capture_leave_on_<N>gpu.json (step_ms, compiled_step_ms, point_ms,
# point_bytes, ...) and job_capture_leave_on_<N>gpu.txt (the table and torchrun's log). Flight Recorder is on for the
# job's groups (--flight-recorder), as a capture made at the top of the script (or the zero-code one) turns it on
# before the job's first group: the "off" baseline then runs with it on too.
# Device tool: run(command="WB_COMMIT=... bash scripts/job_capture_gpu.sh", carry=[".whl"], kind="nvidia-h100-x4").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
N=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
N=${N:-4}
{
  nvidia-smi -L 2>/dev/null
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__, \
'main', '${WB_COMMIT:-}')"
  env | grep -E '^(TORCH_FR|TORCH_NCCL_TRACE|NCCL_NVLS)' || true
} 2>&1 | tee "$OUT/env_capture.txt"
t0=$(date +%s)
timeout -k 20 "${LIMIT:-560}" $PY -m torch.distributed.run --standalone --nproc-per-node "$N" \
  benchmarks/job_capture.py --shape "${SHAPE:-llama-3.2-1b}" --steps "${STEPS:-6}" \
  --out "$OUT/job_capture_leave_on_${N}gpu.json" --runs /tmp/wb-job-capture --flight-recorder \
  ${MODES:+--modes "$MODES"} ${ROUNDS:+--rounds "$ROUNDS"} ${EXTRA:-} \
  2>&1 | grep -v -E "Warning|warnings.warn|^\s*$" | tee "$OUT/job_capture_leave_on_${N}gpu.txt"
rc=${PIPESTATUS[0]}
echo "job_capture: $(( $(date +%s) - t0 ))s, rc=$rc" | tee -a "$OUT/job_capture_leave_on_${N}gpu.txt"
ps -eo pid,args | grep -E "job_capture.py" | grep -v grep || echo "no process left"
exit $rc
