#!/usr/bin/env bash
# The NCCL frame-state check (issue 38) and the hang cycles, from the repo root of a machine with N GPUs:
#     RANKS=2 bash scripts/gpu_frame_state.sh
# Device tool: run(command="bash scripts/gpu_frame_state.sh", carry=[".whl"], kind="nvidia-h100-x2").
# Leaves in $OUT: frame_state_nccl_<N>gpu.txt/.json (scripts/gpu_frame_state.py: a released deadlock's frame
# is failed and settled when s.step() returns it, recover() never replays the step that hung, cold and warm
# NCCL connections) and, unless CYCLES=0, hang_cycles_nccl_<N>gpu.txt/.json (benchmarks/hang_cycles.py).
# OLD=dir: also run the frame-state check with dir/session.py as the client's session (the code before the
# fix), into frame_state_nccl_<N>gpu_old.txt: it must fail there.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
n=${RANKS:-2}
nvidia-smi -L 2>&1 | tee "$OUT/gpus_${n}.txt"
rc=0
if [ -n "${OLD:-}" ]; then
  old=$(mktemp -d)
  cp -r workbench "$old/" && cp "$OLD/session.py" "$old/workbench/live/session.py"
  PYTHONPATH="$old:$PYTHONPATH" timeout -k 5 "${OLD_LIMIT:-120}" $PY scripts/gpu_frame_state.py --ranks "$n" \
    --cycles "${OLD_CYCLES:-2}" 2>&1 | grep -v Warning | tee "$OUT/frame_state_nccl_${n}gpu_old.txt"
fi
timeout -k 5 "${FRAME_LIMIT:-150}" $PY scripts/gpu_frame_state.py --ranks "$n" --cycles "${FRAME_CYCLES:-5}" \
  --out "$OUT/frame_state_nccl_${n}gpu.json" 2>&1 | grep -v Warning | tee "$OUT/frame_state_nccl_${n}gpu.txt"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
if [ "${CYCLES:-20}" != 0 ]; then
  timeout -k 5 "${HANG_LIMIT:-240}" $PY benchmarks/hang_cycles.py --backend nccl --by ledger --ranks "$n" \
    --cycles "${CYCLES:-20}" --deaths "${DEATHS:-1}" --timeout 30 --json "$OUT/hang_cycles_nccl_${n}gpu.json" 2>&1 \
    | grep -v Warning | tee "$OUT/hang_cycles_nccl_${n}gpu.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1 | tail -n +2 | wc -l \
  | xargs echo "GPU processes left:"
exit $rc
