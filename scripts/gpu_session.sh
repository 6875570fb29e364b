#!/usr/bin/env bash
# One device-tool call for everything that needs GPUs this round (a machine start costs minutes):
#     run(command="bash scripts/gpu_session.sh", carry=[".whl"], kind="nvidia-h200-x2")
# 1. the GPU suite for the given scenarios (default: the weight-sync ones) plus the probe-at-scale benchmark,
# 2. NCCL hang cycles declared from the ledgers (benchmarks/hang_cycles.py --backend nccl),
# 3. attach to an ipcluster started by script (scripts/gpu_attach.sh),
# 4. nvidia-smi afterwards: no process of ours may hold GPU memory.
# Everything lands in $OUT (suite.log, gpu_suite.tgz, probe_scale.json, hang_cycles_nccl.txt, attach.txt, smi.txt).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SCEN=${SCEN:-"weight-sync-rank0-metadata router-bias-bf16 weight-sync-order-desync stale-conversion-cache"}
SUITE_LIMIT=${SUITE_LIMIT:-240} PROBE_LIMIT=${PROBE_LIMIT:-90} bash scripts/gpu_suite.sh --only $SCEN
PYTHONPATH=/tmp/site:$PWD timeout -k 5 "${HANG_LIMIT:-150}" python3 benchmarks/hang_cycles.py --backend nccl \
  --cycles "${HANG_CYCLES:-3}" --deaths 0 --timeout 5 2>&1 | grep -v Warning | tee "$OUT/hang_cycles_nccl.txt"
timeout -k 5 "${ATTACH_LIMIT:-120}" bash scripts/gpu_attach.sh 2>&1 | tail -40
nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1 | tee "$OUT/smi.txt"
ps -eo pid,args | grep -c "[i]pengine\|[i]pyparallel" | xargs echo "ipyparallel processes left:" | tee -a "$OUT/smi.txt"
