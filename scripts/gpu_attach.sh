#!/usr/bin/env bash
# Attach to GPU engines started by a script, the way a multi-host job would: from the repo root of a
# machine with >= 2 GPUs,
#     bash scripts/gpu_attach.sh
# 1. `ipcluster start -n 2 --daemonize` (a separate process; the workbench launches nothing),
# 2. `workbench status`, then `workbench run fsdp1-rotary-meta-init --cluster P` on NCCL: the bug path,
#    then the fix path twice (the second is the warm figure), each timed,
# 3. wb.connect(P) in Python: ranks take GPUs 0 and 1 by local index, stop() leaves the engines up,
# 4. `workbench down --profile P`, then checks that no ipyparallel process of it is left.
# Leaves $OUT/attach.txt (default ./gpu-out). Installs carried wheels from .whl/ when ipyparallel is missing.
# Device tool: run(command="bash scripts/gpu_attach.sh", carry=[".whl"], kind="nvidia-h200-x2").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
P=$(mktemp -d)/profile_gpu
WB="$PY -m workbench.cli"
SC=fsdp1-rotary-meta-init
cleanup() { $WB down --profile "$P" >/dev/null 2>&1 || true; }
trap cleanup EXIT
BACKEND=${BACKEND:-nccl}  # BACKEND=gloo tries the script on a CPU box
timed() {
  local t0 rc; t0=$(date +%s%N); "$@"; rc=$?
  echo "wall $(( ($(date +%s%N) - t0) / 1000000 )) ms (rc $rc): ${*:3}"
}
{
  nvidia-smi -L 2>/dev/null
  echo "== ipcluster start -n 2 --profile-dir $P --daemonize"
  timed $PY -m ipyparallel.cluster start -n 2 --profile-dir "$P" --daemonize --log-level=WARN
  sleep 2
  $WB status --profile "$P"
  echo "== bug path, attached"
  timed $WB run $SC --cluster "$P" --backend "$BACKEND" --timeout 20 --json "$OUT/attach_bug.json"
  echo "== fix path, attached (twice: the second is warm)"
  timed $WB run $SC --fix cast-params-only --cluster "$P" --backend "$BACKEND" --timeout 20
  timed $WB run $SC --fix cast-params-only --cluster "$P" --backend "$BACKEND" --timeout 20 | grep -E "total|wall"
  echo "== wb.connect in Python"
  $PY - "$P" "$BACKEND" <<'PYEOF'
import sys, psutil, workbench as wb
c = wb.connect(sys.argv[1], backend=sys.argv[2], timeout=20)
print(c, "devices", c.devices, "local index", c.local_index, "master", c.master_addr, c.port)
if sys.argv[2] == "nccl":
    assert c.backend == "nccl" and c.devices == {0: "cuda:0", 1: "cuda:1"}, c.devices
s = c.session("fsdp1-rotary-meta-init", fix="cast-params-only"); s.run()
print("diagnosis:", s.diagnose().sentence); s.close()
pids = list(c.pids.values()); c.stop()
print("after stop(): engines alive", all(psutil.pid_exists(p) for p in pids))
PYEOF
  echo "== workbench down"
  pids=$($PY -c "import sys; from workbench.live import registry; print(*registry.processes(sys.argv[1]))" "$P")
  timed $WB down --profile "$P"
  left=0; for p in $pids; do kill -0 "$p" 2>/dev/null && left=$((left + 1)); done
  echo "processes of the cluster before down: $(echo $pids | wc -w), left after: $left"
} 2>&1 | tee "$OUT/attach.txt"
