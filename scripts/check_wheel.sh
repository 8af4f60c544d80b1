#!/usr/bin/env bash
# Build the wheel like the build the tests ran (no build isolation, the same
# compiler, flags and CUTLASS headers: the compiled module must be
# byte-identical to the one `make test` imported), repair it into a manylinux
# wheel (auditwheel: libgomp is vendored), install it into a fresh virtualenv
# with the CPU torch and import it from outside the source tree: the compiled
# module must be inside the wheel and load with no GPU driver.
#   WHEELHOUSE=dir  keep the repaired wheel there
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1

# build/lib.* is what setuptools packs: clear what an earlier wheel left there.
rm -rf build/lib.*
"$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$WORK/raw"
RAW=$(ls "$WORK"/raw/compass_kernels-*.whl)
# The module in the wheel is the one the tests imported (same build dir).
"$PY" - "$RAW" <<'PY'
import hashlib, sys, zipfile
from pathlib import Path
import compass_kernels
# Test and development tooling lives in tests/ and bench/, never in the package.
DEV_ONLY = ("aot.py", "triton_interpreter.py", "mutants.py", "fp8_quality.py")
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("compass_kernels/") and name.rsplit("/", 1)[-1] in DEV_ONLY:
            sys.exit(f"{name}: development tooling must not ship in the wheel (tests/, bench/)")
        if not name.startswith(("compass_kernels/", "compass_kernels-")):
            sys.exit(f"{name}: the wheel holds the compass_kernels package only")
        if name.startswith("compass_kernels/_C") and name.endswith(".so"):
            tested = Path(compass_kernels.__file__).parent / Path(name).name
            same = hashlib.sha256(z.read(name)).digest() == hashlib.sha256(tested.read_bytes()).digest()
            print(f"{name}: {'identical to the tested build' if same else 'DIFFERS from ' + str(tested)}")
            if not same:
                sys.exit(1)
PY
PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel repair "$RAW" -w "$WORK/wheelhouse"
WHEEL=$(ls "$WORK"/wheelhouse/compass_kernels-*.whl)
echo "built $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
case $(basename "$WHEEL") in *manylinux*) ;; *) echo "not a manylinux wheel: $WHEEL"; exit 1 ;; esac
# (not `zipfile -l | grep -q`: grep exits at the first match and, under
# pipefail, the listing's broken pipe failed the check once the wheel grew)
python3 - "$WHEEL" <<'PY' || exit 1
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
if not any(n.startswith("compass_kernels/_C.") and n.endswith(".so") for n in names):
    sys.exit("wheel has no compiled module compass_kernels/_C")
PY
[ -z "${WHEELHOUSE:-}" ] || { mkdir -p "$WHEELHOUSE"; cp "$WHEEL" "$WHEELHOUSE/"; }

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
