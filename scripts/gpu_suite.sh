#!/usr/bin/env bash
# The GPU suite in one command, from the repo root of a machine with N GPUs:
#     bash scripts/gpu_suite.sh [gpu_suite.py args, e.g. --only fsdp1-rotary-meta-init]
# It installs carried wheels from .whl/ when ipyparallel is missing (see
# ../shared/tools/gpu-wheels.sh), keeps NVLink multicast off, runs every catalogue
# scenario's bug path and fixes on NCCL (scripts/gpu_suite.py) after the probe-at-scale
# benchmark, and leaves in $OUT (default ./gpu-out): suite.txt (the table), suite.log,
# probe_scale.json/.log and gpu_suite.tgz (every per-run JSON and bundle, flat).
# Device tool: run(command="bash scripts/gpu_suite.sh", carry=[".whl"], kind="nvidia-h200-x2").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
work=$(mktemp -d)
mkdir -p "$work/suite"
{
  nvidia-smi -L 2>/dev/null
  $PY -c "import torch, transformers, ipyparallel; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-', 'gpus', torch.cuda.device_count(), \
'transformers', transformers.__version__, 'ipyparallel', ipyparallel.__version__)"
} 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
if [ "${SKIP_PROBE:-0}" != 1 ]; then
  timeout -k 5 "${PROBE_LIMIT:-180}" $PY benchmarks/probe_scale.py --out "$OUT/probe_scale.json" ${PROBE_ARGS:-} 2>&1 \
    | tee "$OUT/probe_scale.log"
fi
t1=$(date +%s)
# Bounded, so the tarball below is always written, whatever a scenario does to the GPUs.
timeout -k 10 "${SUITE_LIMIT:-480}" $PY scripts/gpu_suite.py --out "$work/suite" "$@" 2>&1 | tee "$OUT/suite.log"
suite_rc=${PIPESTATUS[0]}
cp "$work/suite/suite.txt" "$OUT/" 2>/dev/null
t2=$(date +%s)
tar czf "$OUT/gpu_suite.tgz" -C "$work" suite
echo "probe benchmark $((t1 - t0))s; suite rc=$suite_rc in $((t2 - t1))s"
exit "$suite_rc"
