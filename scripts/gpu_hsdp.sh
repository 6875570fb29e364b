#!/usr/bin/env bash
# Issue 48's NCCL recording in one device call, from the repo root of a machine with 4 GPUs:
#     bash scripts/gpu_hsdp.sh
# hsdp-replicas-diverge-at-init (its bug path and both fixes) on NCCL over a 2 x 2 ("replicate", "shard") mesh,
# through scripts/gpu_suite.sh (--ranks 4, no probe benchmark). Leaves in $OUT exactly the files fixtures/gpu/
# keeps (copy them there; tests/test_gpu_fixtures.py then reads them and its NOT_YET_ON_NCCL entries go):
# hsdp-replicas-diverge-at-init__{bug,seed-per-shard,broadcast-along-replicate}.{bundle,json},
# suite_hsdp.{txt,json,log} and env_hsdp.txt.
# Device tool: run(command="bash scripts/gpu_hsdp.sh", carry=[".whl"], kind="nvidia-h100-x4").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
final=$OUT
work=$(mktemp -d)
OUT=$work SKIP_PROBE=1 SUITE_LIMIT=${SUITE_LIMIT:-420} bash "$(dirname "$0")/gpu_suite.sh" \
  --only hsdp-replicas-diverge-at-init --ranks "${RANKS:-4}"
rc=$?
tar xzf "$work/gpu_suite.tgz" -C "$work"
cp "$work"/suite/hsdp-replicas-diverge-at-init__* "$final"/ 2>/dev/null
cp "$work/suite/suite.json" "$final/suite_hsdp.json" 2>/dev/null
cp "$work/suite.txt" "$final/suite_hsdp.txt" 2>/dev/null
cp "$work/suite.log" "$final/suite_hsdp.log" 2>/dev/null
cp "$work/env.txt" "$final/env_hsdp.txt" 2>/dev/null
ls -la "$final"
exit "$rc"
