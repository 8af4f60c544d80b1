#!/usr/bin/env bash
# Build a wheel with `pip wheel .`, install it into a fresh virtualenv with the
# CPU torch, and import it from outside the source tree: the compiled module
# must be inside the wheel and load with no GPU driver.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1

python3 -m pip wheel -q --no-deps . -w "$WORK/wheelhouse"
WHEEL=$(ls "$WORK"/wheelhouse/compass_kernels-*.whl)
echo "built $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
python3 -m zipfile -l "$WHEEL" | grep -q "compass_kernels/_C" ||
  { echo "wheel has no compiled module compass_kernels/_C"; exit 1; }

python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q torch==2.13.0
"$WORK/venv/bin/pip" install -q "$WHEEL"
cd "$WORK"
"$WORK/venv/bin/python" - <<'PY'
import compass_kernels as ck, torch
d = ck.info()
assert d["compiled"]["loaded"], d
assert "site-packages" in ck.__file__, ck.__file__
adv, zv, _ = ck.advantages.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
assert zv.tolist() == [False, False, True, True], zv
print("wheel ok:", ck.__file__, "cuda kernels compiled:", d["compiled"]["cuda"],
      d["compiled"]["cuda_archs"])
PY
cd "$ROOT"
