#!/usr/bin/env bash
# Issue 62: the two ways' points on the job's thread (benchmarks/point_ways.py) after the owner cache (fc19edb) and
# the probe at scale (benchmarks/probe_scale.py, NVRTC's kernel) as they read now; one device call (~4 min, one H200).
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_reread.sh
# PROBE_ARGS goes to probe_scale.py as it is (e.g. --splits '0.5;0.2,0.7': the launches cut elsewhere, compared).
# Then the probe's host-side pieces one by one (benchmarks/probe_micro.py).
# Leaves in $OUT: env.txt, point_ways_1gpu.json/.txt, probe_scale_nvrtc_1gpu.json/.txt, probe_micro_1gpu.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
record_env
timeout -k 10 300 $PY benchmarks/point_ways.py --shape llama-3.2-1b --pairs 60 --rounds 1 \
  --out "$OUT/point_ways_1gpu.json" 2>&1 | tee "$OUT/point_ways_1gpu.txt"
timeout -k 10 200 $PY benchmarks/probe_scale.py --out "$OUT/probe_scale_nvrtc_1gpu.json" ${PROBE_ARGS:-} 2>&1 \
  | tee "$OUT/probe_scale_nvrtc_1gpu.txt" | tail -30
echo "rc=${PIPESTATUS[0]}"
timeout -k 10 120 $PY benchmarks/probe_micro.py 2>&1 | tee "$OUT/probe_micro_1gpu.txt"
