#!/usr/bin/env bash
# Create .venv and install the project with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# constraints.txt pins every package (scripts/lock.sh): the same versions on every machine.
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test,bench]"
