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
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
if ! $PY -c "import ipyparallel" 2>/dev/null; then
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site
  else
    echo "ipyparallel missing and no .whl/ carried (run ../shared/tools/gpu-wheels.sh first)"; exit 1
  fi
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
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
