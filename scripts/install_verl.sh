#!/usr/bin/env bash
# Install verl 0.9.1 for compass's verl drop-in into the active Python environment:
# pyproject's `verl-deps` extra (resolved normally), then the `verl` extra's exact pins
# with --no-deps (verl's own requirements would replace torch / vLLM / transformers).
# Run from a checkout: scripts/install_verl.sh   (scripts/setup_env.sh runs it too).
#   COMPASS_PIP        the pip command (default: python -m pip)
#   COMPASS_VERL_DEPS  0: skip the verl-deps resolve (setup_env.sh resolves it with the rest)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${COMPASS_PIP:-python -m pip}
extra() {
  python -c "import sys, tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))\
['project']['optional-dependencies'][sys.argv[1]]))" "$1"
}
if [ "${COMPASS_VERL_DEPS:-1}" = 1 ]; then
  # shellcheck disable=SC2046
  $PIP install -q $(extra verl-deps)
fi
# shellcheck disable=SC2046
$PIP install -q --no-deps $(extra verl)
python - <<'PY'
import importlib.metadata as md
import tomllib

pins = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["verl"]
wrong = []
for pin in pins:
    name, version = pin.split("==")
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        got = None
    if got != version:
        wrong.append(f"{name} {got} (pinned {version})")
if wrong:
    raise SystemExit("install_verl: " + ", ".join(wrong))
print(f"install_verl: {len(pins)} pinned packages in place (verl {md.version('verl')})")
PY
