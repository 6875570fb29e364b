#!/usr/bin/env bash
# Issue 62: one warm in-code job of job_leave_on.py failed at `from transformers import LlamaForCausalLM` (rc 1,
# "Could not import module 'LlamaForCausalLM'", 9c09923) while its fresh twin and every zero-code job ran. This runs
# that job RUNS times (warm caches from a first run, in-code and zero-code in turns) and keeps each failure's whole
# stderr, to find the cause. One device call (~3 min on one H200):
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_import_race.sh
# Leaves in $OUT: env.txt, import_race.txt (each run's rc and the head of a failure's cause), fail_*.log.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
record_env
work=$(mktemp -d)
export TRITON_CACHE_DIR=$work/triton TORCHINDUCTOR_CACHE_DIR=$work/inductor CUDA_CACHE_PATH=$work/cuda OMP_NUM_THREADS=1
job=(benchmarks/job_leave_on.py --role job --shape llama-3.2-1b --steps 3 --no-compile --profile 0 --paired 0)
for i in $(seq 1 "${RUNS:-8}"); do
  if [ $((i % 3)) = 0 ]; then
    cmd=($PY -m workbench.cli job "$work/cap$i" --every 1 -- $PY -m torch.distributed.run --standalone \
         --nproc-per-node 1 "${job[@]}" --mode off --result "$work/r$i.json" --capture "$work/c$i"); way=zero_code
  else
    cmd=($PY -m torch.distributed.run --standalone --nproc-per-node 1 "${job[@]}" --mode defaults \
         --result "$work/r$i.json" --capture "$work/c$i"); way=in_code
  fi
  t0=$(date +%s.%N)
  timeout -k 10 120 "${cmd[@]}" > "$work/run$i.log" 2>&1
  rc=$?
  echo "run $i $way rc $rc $(python3 -c "print(round($(date +%s.%N) - $t0, 1))")s" | tee -a "$OUT/import_race.txt"
  if [ $rc != 0 ]; then
    cp "$work/run$i.log" "$OUT/fail_$i.log"
    grep -n -m 12 -E "Error|error:|partially|circular|Traceback|direct cause" "$work/run$i.log" | tee -a "$OUT/import_race.txt"
  fi
done
