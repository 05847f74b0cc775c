#!/usr/bin/env bash
# kvwarden 0.1.6, a peer gateway with a per-tenant token bucket, in its own environment for the
# `extproc bench self-overload` peer arm (it fronts an already running engine with
# KVWARDEN_DEV_SKIP_ENGINE_LAUNCH=1). Safe to run again. VENV overrides where it goes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-kvwarden}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import kvwarden" 2>/dev/null; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "kvwarden==0.1.6"
fi
"$VENV/bin/python" -c "import kvwarden, sys; print('kvwarden', getattr(kvwarden, '__version__', '?'), sys.prefix)"
