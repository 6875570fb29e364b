#!/usr/bin/env bash
# Issue 62: where the in-code point's cost beyond the zero-code one goes, in one device call (~6 min on one H200).
# The in-code job's points take the model and the step's 262 MB of logits; a zero-code step point the model alone.
# benchmarks/point_cost.py with and without the logits (the job's thread and the writer's drain, by function), then
# the long paired reading with in-code points of the model alone. From the repo root:
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_point_split.sh
# Leaves in $OUT: env.txt, point_cost_{logits,model}_1gpu.json/.txt, paired_no_logits_1gpu.json/.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
record_env
for what in logits model; do
  flag=""; [ "$what" = model ] && flag=--no-logits
  timeout -k 10 150 $PY benchmarks/point_cost.py --shape llama-3.2-1b $flag --out "$OUT/point_cost_${what}_1gpu.json" \
    > "$OUT/point_cost_${what}_1gpu.txt" 2>&1
  head -4 "$OUT/point_cost_${what}_1gpu.txt"
done
timeout -k 20 330 $PY benchmarks/job_leave_on.py --rounds 1 --steps 5 --paired 300 --paired-block 2 --no-compile \
  --no-logits --budget 300 --out "$OUT/paired_no_logits_1gpu.json" 2>&1 | tee "$OUT/paired_no_logits_1gpu.txt"
echo "rc=${PIPESTATUS[0]}"
