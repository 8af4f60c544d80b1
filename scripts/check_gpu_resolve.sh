#!/usr/bin/env bash
# What `pip install "compass_kernels[vllm,megatron,triton]"` resolves to on a GPU host of
# the documented line (README, "GPU line"): Linux x86_64, CPython 3.12. A dry run with the
# platform's tags (`pip install --dry-run --ignore-installed --report`): no GPU, nothing
# installed, only metadata fetched. Fails unless it resolves to a reviewed vLLM pinning
# torch 2.14.0 (0.34, or 0.33 where 0.34's requirements are not all on the registry: said
# loudly), that torch, the Triton it pins (3.8) and megatron-core 0.19.2.
#   PY312  a Python 3.12 with pip (default .venv312/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-.venv312/bin/python}
OUT=${COMPASS_RESOLVE_DIR:-build/gpu-resolve}
mkdir -p "$OUT"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip does not widen --platform to older glibc tags by itself: list manylinux 2_17 .. 2_35
# (glibc 2.35: Ubuntu 22.04, the CUDA 13 images; vLLM 0.34 needs llguidance 1.7, built for 2_31)
PLATFORMS=()
for g in $(seq 17 35); do PLATFORMS+=(--platform "manylinux_2_${g}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform linux_x86_64)
# The project's own requirements for those extras (pyproject.toml, markers evaluated for
# Python 3.12 on Linux): the package itself is a source tree, which a dry run for another
# platform cannot build.
mapfile -t REQS < <("$PY312" - <<'PY'
import tomllib
from packaging.requirements import Requirement
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
reqs = list(p["dependencies"])
for extra in ("vllm", "megatron", "triton"):
    reqs += p["optional-dependencies"][extra]
for r in map(Requirement, reqs):
    if r.marker is None or r.marker.evaluate(env):
        r.marker = None
        print(r)
PY
)
echo "check_gpu_resolve: ${REQS[*]}"
"$PY312" -m pip install -q --dry-run --ignore-installed --only-binary=:all: \
  "${PLATFORMS[@]}" --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --target "$OUT/target" --report "$OUT/report.json" "${REQS[@]}"
"$PY312" - "$OUT/report.json" <<'PY'
import json, sys
got = {i["metadata"]["name"].lower(): i["metadata"]["version"]
       for i in json.load(open(sys.argv[1]))["install"]}
want = {"vllm": ("0.34.", "0.33."), "torch": ("2.14.0",), "megatron-core": ("0.19.2",),
        "triton": ("3.8.",)}
print("check_gpu_resolve:", len(got), "packages;", ", ".join(f"{k} {got.get(k)}" for k in want))
bad = [k for k, v in want.items() if not str(got.get(k, "")).startswith(v)]
if bad:
    sys.exit("check_gpu_resolve: expected " + ", ".join(f"{k} {' or '.join(want[k])}*" for k in bad))
if not got["vllm"].startswith("0.34."):
    # 0.33 is reviewed too and pins the same torch 2.14.0; say loudly why not 0.34
    print(f"check_gpu_resolve: NOTE: vLLM {got['vllm']}, not 0.34: a requirement of vLLM 0.34.0 "
          "is not on the registry (2026-12-06: flashinfer-python==0.7.3; `pip install "
          "--dry-run vllm==0.34.0` with these tags names it)")
PY
