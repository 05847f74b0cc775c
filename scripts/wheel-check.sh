#!/usr/bin/env bash
# The package as a user gets it: build a wheel of this checkout, install it in a clean venv
# outside the checkout, and from a folder outside the checkout run the local demo stack
# (`extproc up --demo`) and check the default policy shipped as package data. Proves the wheel
# carries everything it needs (package data, the lab's entry point), which the editable
# install the tests use cannot show.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
unset PYTHONPATH  # nothing from the checkout may leak into the installed package

work="$(mktemp -d "${TMPDIR:-/tmp}/wheel-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
fail() {
  echo "wheel-check: FAILED: $*" >&2
  exit 1
}
step() { echo "wheel-check: $*"; }

# Build from a copy of the files git knows (tracked, or new and not ignored), so a stale
# build/ folder or local artefacts in the checkout cannot end up in the wheel.
step "building the wheel"
mkdir "$work/src" "$work/dist"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
  | xargs -0 tar -cf - --ignore-failed-read 2>/dev/null) \
  | tar -xf - -C "$work/src" || fail "copying the checkout's files (is it a git work tree?)"
(cd "$work/src" && timeout 600 "$PYTHON" -m pip wheel --quiet --no-deps -w "$work/dist" .) \
  || fail "pip wheel"
wheels=("$work"/dist/*.whl)
[ "${#wheels[@]}" -eq 1 ] && [ -f "${wheels[0]}" ] || fail "expected one wheel, got: ${wheels[*]}"
step "built $(basename "${wheels[0]}")"

step "installing it in a clean venv"
"$PYTHON" -m venv "$work/venv"
venv="$work/venv/bin"
timeout 900 "$venv/python" -m pip install --quiet "${wheels[0]}" || fail "pip install of the wheel"

mkdir "$work/run"
cd "$work/run"
installed="$(timeout 60 "$venv/python" -c 'import extproc; print(extproc.__file__)')"
case "$installed" in
  "$work/venv/"*) ;;
  *) fail "extproc was imported from $installed, not from the clean venv" ;;
esac
policy="$(timeout 60 "$venv/python" -c \
  'from extproc.defaults import default_policy_path; print(default_policy_path())')"
[ -f "$policy" ] || fail "the packaged default policy is missing: $policy"

step "extproc policy check $policy"
timeout 60 "$venv/extproc" policy check "$policy" || fail "extproc policy check on the packaged default"

step "extproc up --demo"
status=0
timeout 300 "$venv/extproc" up --demo --workdir "$work/up" >"$work/demo.log" 2>&1 || status=$?
cat "$work/demo.log"
if [ "$status" -ne 0 ] || ! grep -qx "demo passed" "$work/demo.log"; then
  for log in "$work"/up/*.log; do
    [ -f "$log" ] && { echo "--- $log"; tail -n 40 "$log"; }
  done
  fail "extproc up --demo (exit $status) did not print \"demo passed\""
fi
step "passed"
