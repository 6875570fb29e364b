#!/usr/bin/env bash
# Issue 38's second round in one device call, from the repo root of a machine with 4 GPUs:
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_real_size.sh
# 1. weight-sync-order-desync's bug path traced at 4 NCCL ranks (scripts/gpu_order_desync_trace.py): with the
#    release aborting each group's backend (rank/control.py), no 'Group ... is not registered' among the errors;
# 2. benchmarks/real_size.py (Qwen3-1.7B shape, FSDP2): 4 then 2 ranks, each with an empty Triton cache
#    (real_size.json; PASSES=N warm passes), then, unless BASE=0, 4 ranks with the probe warm-up off (the
#    baseline, real_size_nowarm.json);
# 3. the frame-state check and the hang cycles at 4 ranks (scripts/gpu_frame_state.sh): recovery still right
#    with the registry kept (the re-form destroys aborted groups).
# REPEAT=1 (with TRACE=0 REAL=0 CYCLES=0): the 4-rank real_size three times on one machine (its first process
# with an empty Triton cache, the second with that cache kept, a third with an empty one again), into
# real_size_repeat.txt and real_size_4gpu_run{1,2,3}.json. GC=1: 4 ranks, four warm passes, Python's collections
# timed on the ranks, then the same with the heap frozen from each probe to the next step (a prototype), into
# real_size_gc.txt, real_size_gc.json, real_size_gc_freeze.json.
# Leaves in $OUT: env.txt, order_desync_trace_4gpu.txt, real_size.txt/.json, real_size_nowarm.json,
# frame_state_nccl_4gpu.txt, hang_cycles_nccl_4gpu.txt, round.tgz (their JSONs).
# Device tool: run(command="WB_COMMIT=... bash scripts/gpu_real_size.sh", carry=[".whl"], kind="nvidia-h200-x4").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export WB_COMMIT=${WB_COMMIT:-}
final=$OUT
work=$(mktemp -d)
rc=0
{
  nvidia-smi -L 2>/dev/null
  $PY -c "import torch, triton, transformers, ipyparallel; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), 'triton', triton.__version__, \
'transformers', transformers.__version__, 'ipyparallel', ipyparallel.__version__, 'main', '$WB_COMMIT'); \
import torch.distributed as d; print('ProcessGroup.abort:', hasattr(d.ProcessGroup, 'abort'))"
} 2>&1 | tee "$final/env.txt"
t0=$(date +%s)
if [ "${TRACE:-1}" = 1 ]; then
  timeout -k 5 "${TRACE_LIMIT:-100}" $PY scripts/gpu_order_desync_trace.py --ranks 4 2>&1 | grep -v Warning \
    | tee "$final/order_desync_trace_4gpu.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "trace $(( $(date +%s) - t0 ))s"
fi
if [ "${REAL:-1}" = 1 ]; then
  {
    timeout -k 5 "${REAL_LIMIT:-200}" $PY benchmarks/real_size.py --ranks 4 2 --triton-cache fresh \
      --passes "${PASSES:-1}" --json "$final/real_size.json"
    if [ "${BASE:-1}" = 1 ]; then
      WORKBENCH_PROBE_WARM=0 timeout -k 5 "${BASE_LIMIT:-100}" $PY benchmarks/real_size.py --ranks 4 \
        --triton-cache fresh --json "$final/real_size_nowarm.json"
    fi
  } 2>&1 | grep -v Warning | tee "$final/real_size.txt"
  echo "real size $(( $(date +%s) - t0 ))s"
fi
if [ "${REPEAT:-0}" = 1 ]; then  # what the first process on a fresh machine pays, apart from the Triton cache
  tc=$(mktemp -d)
  {
    for i in 1 2; do  # 1: the machine's first run, Triton cache empty; 2: the cache kept (built once per machine)
      timeout -k 5 "${REAL_LIMIT:-100}" $PY benchmarks/real_size.py --ranks 4 --triton-cache "$tc" \
        --json "$final/real_size_4gpu_run$i.json"
    done  # 3: an empty Triton cache again, on the now warm machine
    timeout -k 5 "${REAL_LIMIT:-100}" $PY benchmarks/real_size.py --ranks 4 --triton-cache fresh \
      --json "$final/real_size_4gpu_run3.json"
  } 2>&1 | grep -v Warning | tee "$final/real_size_repeat.txt"
  echo "repeat $(( $(date +%s) - t0 ))s"
fi
if [ "${GC:-0}" = 1 ]; then  # where a ~0.2 s pause in a probe comes from: Python's collections, timed on the ranks
  {
    timeout -k 5 "${REAL_LIMIT:-120}" $PY benchmarks/real_size.py --ranks 4 --passes 4 --json "$final/real_size_gc.json"
    timeout -k 5 "${REAL_LIMIT:-120}" $PY benchmarks/real_size.py --ranks 4 --passes 4 --gc-freeze \
      --json "$final/real_size_gc_freeze.json"
  } 2>&1 | grep -v Warning | tee "$final/real_size_gc.txt"
  echo "gc $(( $(date +%s) - t0 ))s"
fi
if [ "${CYCLES:-20}" != 0 ]; then
  OUT=$work RANKS=4 FRAME_CYCLES=${FRAME_CYCLES:-2} FRAME_LIMIT=${FRAME_LIMIT:-90} HANG_LIMIT=${HANG_LIMIT:-150} \
    CYCLES=${CYCLES:-20} bash scripts/gpu_frame_state.sh >/dev/null 2>&1 || rc=1
  for f in frame_state_nccl_4gpu.txt hang_cycles_nccl_4gpu.txt; do [ -f "$work/$f" ] && cp "$work/$f" "$final/"; done
  tail -3 "$final/frame_state_nccl_4gpu.txt" 2>/dev/null; grep -E "check|recovery \(|restarted" \
    "$final/hang_cycles_nccl_4gpu.txt" 2>/dev/null | head -5
  echo "frame state + cycles $(( $(date +%s) - t0 ))s"
fi
[ -n "$(ls "$work")" ] && tar czf "$final/round.tgz" -C "$work" $(cd "$work" && ls *.json gpus_*.txt 2>/dev/null)
echo "rc=$rc"
exit $rc
