#!/usr/bin/env bash
# A compiled copy of this checkout's runtime, for the benchmarks' compiled arms (a lab tool:
# the package ships pure Python; docs/benchmarks.md, "The compiled build, end to end"):
#   bash scripts/build-compiled.sh [DIR]                     (default DIR: .compiled/)
#   extproc bench overhead --compiled-src .compiled
#   extproc bench self-overload --compiled-src .compiled --arms alone-straight,room-fifo,room-full,room-compiled
# Copies extproc/ into DIR and compiles the modules below there with mypyc, in place; the
# checkout itself is never compiled (a compiled module beside its source would shadow later
# edits of it). Needs mypy (the test extra) and a C compiler; ~2 minutes on 2 cores.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
target="$(realpath -m "${1:-$repo/.compiled}")"
MYPYC="${MYPYC:-$repo/.venv/bin/mypyc}"

# The modules every request and every streamed chunk runs through. Protocols stay Python
# classes (mypyc would make them native ones); modules with async generators cannot be built.
modules=(
  extproc/sse.py extproc/estimation.py extproc/openai_request.py extproc/prompt.py
  extproc/routing.py extproc/admission.py extproc/service/accounting.py
  extproc/service/request.py extproc/service/gateway.py
)
while IFS= read -r module; do
  modules+=("$module")
done < <(cd "$repo" && find extproc/scheduler -name '*.py' ! -name protocol.py | sort)

rm -rf "$target"
mkdir -p "$target"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard -- extproc pyproject.toml \
  | xargs -0 tar -cf - --ignore-failed-read 2>/dev/null) | tar -xf - -C "$target"
(cd "$target" && timeout 1200 "$MYPYC" "${modules[@]}" >build.log 2>&1) \
  || { tail -n 40 "$target/build.log"; echo "build-compiled: FAILED (mypyc)" >&2; exit 1; }
rm -rf "$target/build"
compiled="$(find "$target/extproc" -name '*.so' | wc -l)"
if [ "$compiled" -eq 0 ]; then
  echo "build-compiled: no module was compiled; see $target/build.log" >&2
  exit 1
fi
echo "build-compiled: $compiled compiled modules in $target"
echo "use it: PYTHONSAFEPATH=1 PYTHONPATH=$target python -m extproc serve ..."
