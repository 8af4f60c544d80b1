#!/usr/bin/env bash
# The vLLM source pins (compass_kernels/integration/vllm/_pin.py) against the releases'
# wheels, read from the zip, never installed: every pinned release, and the newest vLLM
# on the registry, so a release nobody has reviewed fails here before a user meets it.
# The wheels (~250-340 MB each) are kept in $COMPASS_VLLM_WHEELS (default
# build/vllm-wheels): a rerun downloads only the newest release's metadata.
#   PY  the interpreter with compass_kernels importable (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DIR=${COMPASS_VLLM_WHEELS:-build/vllm-wheels}
mkdir -p "$DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# the wheels are cp38-abi3 manylinux_2_28 x86_64: the GPU hosts' platform, any Python
TAGS=(--only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.12)

pinned=$("$PY" -c "from compass_kernels.integration.vllm._pin import PINS; print(' '.join(PINS))")
# The newest release: its metadata only (no download, no dependencies).
"$PY" -m pip install -q --dry-run --no-deps --ignore-installed "${TAGS[@]}" \
  --target "$DIR/.dry-run" --report "$DIR/newest.json" vllm 2>/dev/null
newest=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['install'][0]['metadata']['version'])" \
  "$DIR/newest.json")
echo "check_vllm_pins: pinned releases: $pinned; newest on the registry: $newest"

args=()
for v in $(printf '%s\n' $pinned "$newest" | sort -uV); do
  wheel=$(ls "$DIR"/vllm-"$v"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    "$PY" -m pip download -q --no-deps "${TAGS[@]}" -d "$DIR" "vllm==$v"
    wheel=$(ls "$DIR"/vllm-"$v"-*.whl | head -1)
  fi
  args+=(--wheel "$wheel")
done
"$PY" -m compass_kernels.integration.vllm._pin "${args[@]}"
