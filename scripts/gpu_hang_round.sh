#!/usr/bin/env bash
# Issue 38's GPU round at N ranks in one device call (a machine start costs minutes):
#     RANKS=4 bash scripts/gpu_hang_round.sh
# Device tool: run(command="RANKS=4 bash scripts/gpu_hang_round.sh", carry=[".whl"], kind="nvidia-h100-x4").
# 1. the NCCL frame-state check and the hang cycles (scripts/gpu_frame_state.sh),
# 2. the catalogue (scripts/gpu_suite.sh, SKIP_PROBE=1) unless SUITE=0,
# 3. weight-sync-order-desync's bug path traced step by step (scripts/gpu_order_desync_trace.py) unless TRACE=0.
# $OUT gets at most 8 files (the device tool's limit): the three .txt outputs, suite.txt/.log,
# gpu_suite.tgz and round.tgz (every JSON, the GPUs and versions).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
n=${RANKS:-4}
final=$OUT
work=$(mktemp -d)
rc=0
OUT=$work RANKS=$n CYCLES=${CYCLES:-20} FRAME_CYCLES=${FRAME_CYCLES:-2} FRAME_LIMIT=${FRAME_LIMIT:-110} \
  HANG_LIMIT=${HANG_LIMIT:-170} bash scripts/gpu_frame_state.sh || rc=1
if [ "${SUITE:-1}" = 1 ]; then
  OUT=$work SKIP_PROBE=1 SUITE_LIMIT=${SUITE_LIMIT:-200} bash scripts/gpu_suite.sh --ranks "$n" || rc=1
fi
if [ "${TRACE:-1}" = 1 ]; then
  timeout -k 5 "${TRACE_LIMIT:-100}" $PY scripts/gpu_order_desync_trace.py --ranks "$n" 2>&1 | grep -v Warning \
    | tee "$work/order_desync_trace_${n}gpu.txt"
fi
for f in "frame_state_nccl_${n}gpu.txt" "hang_cycles_nccl_${n}gpu.txt" "order_desync_trace_${n}gpu.txt" suite.txt \
         suite.log gpu_suite.tgz; do
  [ -f "$work/$f" ] && cp "$work/$f" "$final/"
done
tar czf "$final/round.tgz" -C "$work" $(cd "$work" && ls *.json env.txt gpus_*.txt 2>/dev/null)
exit $rc
