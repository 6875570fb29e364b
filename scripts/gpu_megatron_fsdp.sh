#!/usr/bin/env bash
# Issue 60's Megatron-FSDP proof in one device call, from the repo root of a machine with N GPUs (1 counts):
#     WB_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_megatron_fsdp.sh
# A user's MoE job on the real megatron-fsdp 0.6.1 (scripts/gpu_megatron_fsdp_job.py, unmodified, from its own folder):
# the bug (router `expert_bias` clobbered by Megatron-FSDP's `to_empty(recurse=False)`) plainly, then under
# `workbench job` with the defaults and with `--every 1`; its fix (FIX=1) the same two ways. Each capture read by
# `workbench report`. Leaves in $OUT: megatron_fsdp_<N>gpu.tgz (the four captures), megatron_fsdp_<N>gpu.json (each
# run's rc, result and report sentence), and megatron_fsdp.log (every run's output). Needs megatron-fsdp and einops in the carried .whl/:
# ../shared/tools/gpu-wheels.sh megatron-fsdp==0.6.1 einops. Device tool: run(command=..., carry=[".whl"]).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export WB_COMMIT=${WB_COMMIT:-}
n=${NGPU:-$($PY -c "import torch; print(torch.cuda.device_count())")}
job=$(mktemp -d)
cp scripts/gpu_megatron_fsdp_job.py "$job/train.py"  # run from its own folder, as a user's script is
caps="$job/caps"
mkdir -p "$caps" "$job/results"
rc=0
run() {  # name, FIX, workbench flags ("plain": no workbench)
  local name=$1 fix=$2; shift 2
  local res="$job/results/$name"
  local cmd=($PY -m torch.distributed.run --standalone --nproc-per-node "$n" train.py "$res")
  if [ "${1:-}" != plain ]; then cmd=($PY -m workbench.cli job "$caps/$name" "$@" -- "${cmd[@]}"); fi
  (cd "$job" && FIX=$fix timeout -k 10 240 "${cmd[@]}" > "$job/$name.log" 2>&1)
  echo $? > "$job/results/$name.rc"
  if [ "${1:-}" != plain ]; then
    timeout 120 $PY -m workbench.cli report "$caps/$name" -o "$job/results/$name.html" \
      > "$job/results/$name.report.txt" 2>&1 || rc=1
  fi
  { echo "== $name (FIX=$fix $*): rc $(cat "$job/results/$name.rc")"; cat "$job/$name.log"; } >> "$OUT/megatron_fsdp.log"
  echo "== $name (FIX=$fix $*): rc $(cat "$job/results/$name.rc")"; tail -n 3 "$job/$name.log"
  [ -f "$job/results/$name.report.txt" ] && head -c 1500 "$job/results/$name.report.txt" && echo
}
run plain-bug 0 plain
run bug 0
run bug-every1 0 --every 1
run fix 1
run fix-every1 1 --every 1
tar czf "$OUT/megatron_fsdp_${n}gpu.tgz" -C "$caps" bug bug-every1 fix fix-every1 || rc=1
$PY - "$job/results" "$OUT/megatron_fsdp_${n}gpu.json" "$n" <<'PYEOF' || rc=1
import json, os, sys
from pathlib import Path
res, out, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
import torch, megatron_fsdp
doc = {"gpus": n, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
       "megatron_fsdp": getattr(megatron_fsdp, "__version__", None), "main": os.environ.get("WB_COMMIT"), "runs": {}}
for name in ("plain-bug", "bug", "bug-every1", "fix", "fix-every1"):
    r = {"rc": int((res / f"{name}.rc").read_text().strip() or -1)}
    if (res / name / "result.json").exists():
        r["result"] = json.loads((res / name / "result.json").read_text())
    if (res / f"{name}.report.txt").exists():
        r["report"] = (res / f"{name}.report.txt").read_text()[-4000:]
    doc["runs"][name] = r
Path(out).write_text(json.dumps(doc, indent=1))
print(json.dumps({k: (v["rc"], (v.get("report") or "")[:300]) for k, v in doc["runs"].items()}, indent=1))
PYEOF
exit $rc
