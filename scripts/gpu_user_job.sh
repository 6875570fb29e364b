#!/usr/bin/env bash
# A user's own FSDP2 job (scripts/gpu_user_job.py), unmodified, under `workbench job` on 2 GPUs (NCCL): right, a rank
# that lingers after its last step, and a replicated buffer each rank drew itself (DDP=1: also DDP right and
# lingering, its reducer's calls Flight Recorder's only). Each capture read by `workbench report`; the three FSDP2
# captures (no reports) land in $OUT/user_job_nccl_2gpu.tgz (fixtures/gpu/, read by tests/test_gpu_fixtures.py). Device tool: run(command="bash scripts/gpu_user_job.sh", carry=[".whl"],
# kind="nvidia-h200-x2").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
job=$(mktemp -d)
cp scripts/gpu_user_job.py "$job/train.py"  # run from its own folder, as a user's script is
caps="$job/caps"
mkdir -p "$caps"
rc=0
for v in right linger bug ${DDP:+ddp ddp-linger}; do
  case $v in right) flag="";; ddp) flag="--ddp";; ddp-linger) flag="--ddp --linger";; *) flag="--$v";; esac
  (cd "$job" && timeout -k 10 200 $PY -m workbench.cli job "$caps/$v" -- \
     $PY -m torch.distributed.run --nproc-per-node 2 train.py $flag > "$OUT/$v.log" 2>&1) || rc=1
  timeout 120 $PY -m workbench.cli report "$caps/$v" -o "$OUT/$v.html" | tee "$OUT/$v.report.txt" || rc=1
  for r in 0 1; do echo "$v rank $r ledger rows: $(wc -l < "$caps/$v/rank$r/rank$r.jsonl")"; done
done
tar czf "$OUT/user_job_nccl_2gpu.tgz" -C "$caps" right linger bug
exit $rc
