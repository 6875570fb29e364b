#!/usr/bin/env bash
# Issue 62's proof in one device call (any GPU kind; one GPU counts), from the repo root:
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_job_leave_on.sh
# benchmarks/job_leave_on.py: off, in-code defaults and `workbench job --every 1` in interleaved rounds, each job a
# fresh process, the first round with fresh Triton/inductor/CUDA caches; the Llama-3.2-1B shape unsharded, 2 x 512
# tokens, a point every step; first benchmarks/probe_nvrtc.py (the probe's NVRTC kernel against Triton's; a mismatch
# stops the call there). Leaves in $OUT: env.txt, probe_nvrtc_<N>gpu.json/.txt, job_leave_on_<N>gpu.json/.txt.
# Device tool: run(command="WB_COMMIT=... bash scripts/gpu_job_leave_on.sh", carry=[".whl"]).
# The within-job cost to ~1% (150 on/off pairs a capturing job, ~160 s on one H200; fixtures/gpu/paired_leave_on_1gpu.json):
#     python benchmarks/job_leave_on.py --rounds 1 --steps 5 --paired 300 --paired-block 2 --no-compile
# compiled too (round 0 is eager only, so two rounds, ~8 min: a call of its own; fixtures/gpu/paired_compiled_1gpu.json):
#     ... --rounds 2 --steps 5 --paired 300 --paired-block 2 --paired-compiled
# the whole proof that way, in one call (~9 min on one H200; probe_nvrtc.py left out):
#     NVRTC=0 ROUNDS=2 STEPS=5 PAIRED=300 PAIRED_BLOCK=2 PAIRED_COMPILED=1 PROFILE=0 BUDGET=460 LIMIT=540 \
#       bash scripts/gpu_job_leave_on.sh
# fresh caches, eager and compiled, in one round (~5 min; fixtures/gpu/paired_fresh_1gpu.json):
#     ... --rounds 1 --steps 5 --paired 300 --paired-block 2 --fresh-compile --paired-compiled
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export WB_COMMIT=${WB_COMMIT:-}
n=1  # one rank: the job is unsharded, whatever the machine holds
{
  nvidia-smi -L 2>/dev/null
  $PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__, 'triton', triton.__version__, \
'main', '$WB_COMMIT')"
} 2>&1 | tee "$OUT/env.txt"
# the probe's NVRTC kernel against Triton's, in a process with fresh caches (what a job's first point meets)
if [ "${NVRTC:-1}" = 1 ]; then
  CUDA_CACHE_PATH=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) timeout -k 10 120 $PY benchmarks/probe_nvrtc.py \
    --out "$OUT/probe_nvrtc_${n}gpu.json" 2>&1 | tee "$OUT/probe_nvrtc_${n}gpu.txt" || exit 1
fi
t0=$(date +%s)
timeout -k 20 "${LIMIT:-470}" $PY benchmarks/job_leave_on.py --shape "${SHAPE:-llama-3.2-1b}" \
  --rounds "${ROUNDS:-3}" --steps "${STEPS:-22}" --budget "${BUDGET:-380}" --profile "${PROFILE:-6}" --paired "${PAIRED:-30}" --paired-block "${PAIRED_BLOCK:-3}" ${PAIRED_COMPILED:+--paired-compiled} \
  --out "$OUT/job_leave_on_${n}gpu.json" 2>&1 | tee "$OUT/job_leave_on_${n}gpu.txt"
rc=${PIPESTATUS[0]}
echo "leave-on runs $(( $(date +%s) - t0 ))s, rc=$rc" | tee -a "$OUT/job_leave_on_${n}gpu.txt"
exit $rc
