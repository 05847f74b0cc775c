#!/usr/bin/env bash
# Regenerate constraints.txt: build a throwaway venv with the project's extras at their newest
# versions, and record every package it resolved. scripts/setup.sh installs with these pins, so
# test runs and benchmark runs on different days get the same packages (a benchmark's
# results.json records them: `extproc bench provenance A B`). Run it to take upgrades on
# purpose, then run the tests and a benchmark before committing the new file.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install --quiet --upgrade pip
"$scratch/venv/bin/python" -m pip install --quiet -e ".[test,bench]"
{
  echo "# Every package scripts/setup.sh installs, pinned (scripts/lock.sh regenerates this file)."
  "$scratch/venv/bin/python" -m pip freeze --exclude-editable | sort -f
} > constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
