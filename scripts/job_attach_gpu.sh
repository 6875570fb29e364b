#!/usr/bin/env bash
# Issue 37's GPU proof in one device call, from the repo root of a machine with N GPUs (4 here):
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/job_attach_gpu.sh
# torchrun --nproc-per-node N of the Qwen3-1.7B-shaped FSDP2 job (scripts/job_attach_gpu.py), REPEAT (3) times
# one after another: a client on the same machine attaches at cap.breakpoint(), probes the model twice, changes
# it, resumes; timed. Leaves in $OUT: env.txt, job_attach_<N>gpu.json/.txt, job_attach_<N>gpu_run<i>.log.
# Device tool: run(command="WB_COMMIT=... bash scripts/job_attach_gpu.sh", carry=[".whl"], kind="nvidia-h100-x4").
# MODE=post-mortem: capture(attach="on-error"); after STEPS (2) steps rank 1 raises (a bad batch) while the others go
# into that step's collectives; the client attaches post mortem, reads cluster.post_mortem, dumps every rank's thread
# stacks (SIGUSR1), runs a host-side cell, probes (rank 1 alone, every rank on a side stream, then cluster.probe),
# resumes; the job must fail with rank 1's exception and leave no process. Leaves job_postmortem_<N>gpu.json/.txt
# and job_postmortem_<N>gpu_run<i>.log instead. One run takes about 3 min when a probe hangs: REPEAT=1 LIMIT=300.
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
mode=()
[ "${MODE:-breakpoint}" = post-mortem ] && mode=(--post-mortem)
timeout -k 20 "${LIMIT:-500}" $PY scripts/job_attach_gpu.py --shape "${SHAPE:-qwen3-1.7b}" --repeat "${REPEAT:-3}" \
  --steps "${STEPS:-2}" --out "$OUT" "${mode[@]}"
rc=$?
echo "${MODE:-breakpoint} runs $(( $(date +%s) - t0 ))s, rc=$rc"
ps -eo pid,args | grep wb-job-attach- | grep -v grep || echo "no process left"
exit $rc
