#!/usr/bin/env bash
# Issue 62: does the writer's lag take the in-code extra away? One device call (~5 min on one H200): the long
# paired reading, in-code and zero-code, fresh caches, eager; in each job the writer's LAG_S taken in turns pair by
# pair (0: a point's rows made as soon as its kernel is done, as before 2026-11-30; 1 s: once the next point is
# handed over, the default), so each job reads both in one process.
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_writer_lag.sh
# Leaves in $OUT: env.txt, writer_lag_1gpu.json/.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
record_env
timeout -k 20 540 $PY benchmarks/job_leave_on.py --rounds 1 --steps 5 --paired ${PAIRED:-480} --paired-block 2 \
  --no-compile --modes defaults,zero_code --paired-lags 0,1 --budget 420 --out "$OUT/writer_lag_1gpu.json" 2>&1 \
  | tee "$OUT/writer_lag_1gpu.txt"
echo "rc=${PIPESTATUS[0]}"
