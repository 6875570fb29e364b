#!/usr/bin/env bash
# One device-tool call for everything that needs GPUs this round (a machine start costs minutes):
#     run(command="bash scripts/gpu_session.sh", carry=[".whl"], kind="nvidia-h200-x2")
# 1. NCCL hang cycles declared from the ledgers and recovered through the control threads, with a 30 s
#    collective timeout so that nothing but the abort can free the ranks early (benchmarks/hang_cycles.py),
#    and two cycles where NCCL's own watchdog fires first (it must not kill the engine),
# 2. the eval-loop incident's real hang (both ranks blocked), recovered on the same engines, then its fix,
# 3. Flight Recorder dumps of a real 2-GPU NCCL mismatch (scripts/fr_dump.py) into $OUT/flightrecorder,
# 4. attach to an ipcluster started by script (scripts/gpu_attach.sh): bug and fix paths,
# 5. nvidia-smi afterwards: no process of ours may hold GPU memory, no ipyparallel process left.
# SUITE=1 also runs the GPU scenario suite first (scripts/gpu_suite.sh).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
if [ "${SUITE:-0}" = 1 ]; then
  SUITE_LIMIT=${SUITE_LIMIT:-240} PROBE_LIMIT=${PROBE_LIMIT:-90} bash scripts/gpu_suite.sh
fi
timeout -k 5 "${HANG_LIMIT:-150}" $PY benchmarks/hang_cycles.py --backend nccl --by ledger \
  --cycles "${HANG_CYCLES:-10}" --deaths 1 --timeout 30 2>&1 | grep -v Warning | tee "$OUT/hang_cycles_nccl.txt"
# The backstop: no ledger proof, a 5 s collective timeout and an 8 s step deadline, so NCCL's watchdog fires
# first; with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (set by init_rank) it must not kill the engine.
timeout -k 5 "${WATCHDOG_LIMIT:-60}" $PY benchmarks/hang_cycles.py --backend nccl --by deadline \
  --cycles 2 --deaths 0 --timeout 5 --deadline 8 2>&1 | grep -v Warning | tee "$OUT/hang_watchdog_nccl.txt"
timeout -k 5 "${SCEN_LIMIT:-120}" $PY scripts/scenario_hang_cycle.py --backend nccl --cycles 3 2>&1 \
  | grep -v Warning | tee "$OUT/scenario_hang_nccl.txt"
if [ -f scripts/fr_dump.py ]; then
  timeout -k 5 "${FR_LIMIT:-90}" $PY scripts/fr_dump.py --backend nccl --out "$OUT/flightrecorder" 2>&1 \
    | tail -20 | tee "$OUT/fr_dump.txt"
fi
timeout -k 5 "${ATTACH_LIMIT:-120}" bash scripts/gpu_attach.sh 2>&1 | tail -40
nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1 | tee "$OUT/smi.txt"
ps -eo pid,args | grep -c "[i]pengine\|[i]pyparallel" | xargs echo "ipyparallel processes left:" | tee -a "$OUT/smi.txt"
