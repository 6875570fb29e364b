# Sourced by the GPU scripts (gpu_suite.sh, gpu_attach.sh, ...): NVLink multicast off, $OUT made, and the
# carried wheels (.whl/, from ../shared/tools/gpu-wheels.sh) installed when the image lacks ipyparallel; record_env.
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

# What a recording was measured on, into $OUT/env.txt (and the call's output): the GPUs, torch and transformers,
# and the commit (WB_COMMIT, set by the caller).
record_env() {
  {
    nvidia-smi -L 2>/dev/null
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'main', '${WB_COMMIT:-}')"
  } 2>&1 | tee "$OUT/env.txt"
}
