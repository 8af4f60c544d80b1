#!/usr/bin/env bash
# GPU runbook: one call on a lent GPU host, phases in order of value, each under a
# timeout of the time left, results appended as they come (results.jsonl, one JSON
# line per phase), the report rewritten after every phase and by an exit trap, so a
# cut run still leaves one (docs/gpu_runs/README.md gives the device call).
#
#   facts    device facts (GPU, driver, torch, Triton, nvcc)            -> facts.json
#   build    compass_kernels._C, in the background (into build_lib/, copied in
#            place only when the Triton phase is done: no half-written module)
#   triton   every Triton op once against its reference (-m triton)   -> junit_triton.xml
#   timing   bench/gpu_timing.py: every op vs its baseline, GB/s, TFLOP/s, the
#            ceilings of THIS device, measured / model (rows as they come) -> timing.jsonl
#   cutlass  -m cutlass, CUDA_LAUNCH_BLOCKING=1                        -> junit_cutlass.xml
#   cuda     -m gpu (the CUDA backends and the no-sync checks)          -> junit_gpu.xml
#   full     the remaining tiers (unit, sm90 compile checks)            -> junit_full.xml
#
# Usage: scripts/gpu_check.sh [REPORT_DIR]   (default docs/gpu_runs/<date>-<gpu>)
# Knobs: PYTHON (python3); GPU_CHECK_BUDGET_S (540: the whole run, report included);
#   GPU_CHECK_BUNDLE=DIR (after each phase: report.md, report.json, results.jsonl and
#   run.tgz of REPORT_DIR there; the device tool returns at most 8 files);
#   GPU_CHECK_TEST_TIMEOUT (60 s per test, pytest-timeout's thread method: a test
#   stuck in a CUDA call cannot be interrupted by a signal); GPU_CHECK_PYTEST_ARGS.
# Dry run (make gpu-check-dry, tests/test_gpu_check_dry.py): GPU_CHECK_DRY=1 stubs the
#   phases that need a GPU (GPU_CHECK_STUB_S seconds each; GPU_CHECK_STUB_HANG=PHASE
#   makes that stub hang), and cuts can be injected: GPU_CHECK_CUT_PHASE=PHASE (SIGTERM
#   as that phase starts), GPU_CHECK_CUT_AFTER_S=T (SIGTERM after T s),
#   GPU_CHECK_KILL_AFTER_S=T (SIGKILL after T s: no trap runs; the report of the last
#   finished phase stays).
# Without a GPU (and not dry) it fails at once with the reason; it never passes on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
DRY=${GPU_CHECK_DRY:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
RESERVE=${GPU_CHECK_RESERVE_S:-15}  # kept back for the final report
STUB_S=${GPU_CHECK_STUB_S:-0.3}
PHASES=(facts build triton timing cutlass cuda full)
T0=$EPOCHREALTIME

elapsed() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }'; }
left() { awk -v a="$T0" -v b="$EPOCHREALTIME" -v n="$BUDGET" -v r="$RESERVE" \
  'BEGIN { x = n - r - (b - a); printf "%.2f", (x > 0 ? x : 0) }'; }
minf() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (a < b ? a : b) }'; }
positive() { awk -v a="$1" -v m="$MIN_PHASE_S" 'BEGIN { exit !(a >= m) }'; }

if [ "$DRY" != 1 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: FAIL: torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1)) sees no CUDA device" >&2
  command -v nvidia-smi >/dev/null && nvidia-smi -L >&2
  exit 2
fi
if [ "$DRY" = 1 ]; then NAME=DRY; else
  NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
fi
DIR=${1:-docs/gpu_runs/$(date -u +%Y-%m-%d)-$NAME}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
RESULTS="$DIR/results.jsonl"
: >"$RESULTS"
: >"$DIR/log.txt"
BUNDLE=${GPU_CHECK_BUNDLE:-}
CUR_PID="" CUR_PHASE="" CUR_START="" CUR_LIMIT="" CUR_ACTIVE=0 BUILD_PID="" FINISHED=0
WATCH_PIDS=()
MIN_PHASE_S=${GPU_CHECK_MIN_PHASE_S:-5}  # a phase given less than this is skipped

log() { echo "gpu_check [$(elapsed) s] $*" | tee -a "$DIR/log.txt"; }
record() {  # record PHASE STATUS RC SECONDS LIMIT [CMD]: one JSON line in results.jsonl
  local cmd=${6:-}
  cmd=${cmd//\\/\\\\}
  cmd=${cmd//\"/\\\"}
  printf '{"phase": "%s", "status": "%s", "rc": %s, "seconds": %s, "timeout_s": %s, "at_s": %s, "dry": %s, "cmd": "%s"}\n' \
    "$1" "$2" "$3" "$4" "$5" "$(elapsed)" "$([ "$DRY" = 1 ] && echo true || echo false)" "$cmd" >>"$RESULTS"
}
report() {  # the report from what is there now; then the bundle (never fails the run)
  "$PY" scripts/gpu_report.py "$DIR" >"$DIR/report.log" 2>&1 || true
  if [ -n "$BUNDLE" ]; then
    mkdir -p "$BUNDLE"
    for f in report.md report.json results.jsonl; do
      [ -f "$DIR/$f" ] && cp "$DIR/$f" "$BUNDLE/.$f.tmp" && mv "$BUNDLE/.$f.tmp" "$BUNDLE/$f"
    done
    tar czf "$BUNDLE/.run.tgz.tmp" --exclude=build_lib -C "$(dirname "$DIR")" "$(basename "$DIR")" 2>/dev/null &&
      mv "$BUNDLE/.run.tgz.tmp" "$BUNDLE/run.tgz"
  fi
}
on_exit() {
  local rc=$?
  trap - EXIT TERM INT
  local w
  for w in "${WATCH_PIDS[@]}"; do kill "$w" 2>/dev/null; done
  if [ "$CUR_ACTIVE" = 1 ]; then  # a phase was running: stop it, say so
    if [ -n "$CUR_PID" ]; then
      kill -TERM "$CUR_PID" 2>/dev/null
      sleep 0.2
      kill -KILL "$CUR_PID" 2>/dev/null
    fi
    record "$CUR_PHASE" cut 143 "$(awk -v a="$CUR_START" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')" "$CUR_LIMIT"
    log "cut during $CUR_PHASE"
  fi
  if [ -n "$BUILD_PID" ] && ! grep -q '"phase": "build"' "$RESULTS"; then  # still in the background
    kill -TERM "$BUILD_PID" 2>/dev/null
    record build cut 143 "$(awk -v a="$BUILD_START" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')" "$BUILD_LIMIT"
  fi
  if [ "$FINISHED" != 1 ]; then
    local p
    for p in "${PHASES[@]}"; do
      grep -q "\"phase\": \"$p\"" "$RESULTS" || record "$p" "not run" -1 0 0
    done
  fi
  report
  log "report: $DIR/report.md (rc $rc)"
  exit "$rc"
}
trap on_exit EXIT
trap 'log "SIGTERM/SIGINT"; exit 143' TERM INT
if [ -n "${GPU_CHECK_CUT_AFTER_S:-}" ]; then
  { sleep "$GPU_CHECK_CUT_AFTER_S"; kill -TERM $$ 2>/dev/null; } &
  WATCH_PIDS+=($!)
fi
if [ -n "${GPU_CHECK_KILL_AFTER_S:-}" ]; then  # the device tool's hard stop: no trap runs
  { sleep "$GPU_CHECK_KILL_AFTER_S"; kill -KILL $$ 2>/dev/null; } &
  WATCH_PIDS+=($!)
fi

stub_cmd() {  # the dry run's stand-in for phase $1
  echo "$PY" scripts/gpu_check_stub.py "$1" "$DIR" "$STUB_S" "${GPU_CHECK_STUB_HANG:-none}"
}

# run_phase NAME CAP CMD...: CMD under timeout min(CAP, time left), in the background
# (so a signal reaches the trap at once), its output in NAME.log; one result line.
run_phase() {
  local name=$1 cap=$2; shift 2
  local limit; limit=$(minf "$cap" "$(left)")
  CUR_PHASE=$name CUR_START=$EPOCHREALTIME CUR_LIMIT=$limit CUR_ACTIVE=1
  if [ "${GPU_CHECK_CUT_PHASE:-}" = "$name" ]; then
    log "injected cut at the start of $name"
    kill -TERM $$
  fi
  if ! positive "$limit"; then
    CUR_ACTIVE=0
    record "$name" skipped -1 0 "$limit" "no time left"
    log "$name: skipped, no time left"
    return 1
  fi
  log "$name (timeout ${limit} s): $*"
  if [ "$DRY" = 1 ]; then
    # shellcheck disable=SC2046
    timeout -k 1 "$limit" $(stub_cmd "$name") >"$DIR/$name.log" 2>&1 &
  else
    timeout -k 5 "$limit" "$@" >"$DIR/$name.log" 2>&1 &
  fi
  CUR_PID=$!
  wait "$CUR_PID"
  local rc=$?
  local secs; secs=$(awk -v a="$CUR_START" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
  CUR_PID="" CUR_ACTIVE=0
  local status=passed
  [ "$rc" != 0 ] && status=failed
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && status=timeout
  record "$name" "$status" "$rc" "$secs" "$limit" "$*"
  tail -n 15 "$DIR/$name.log" | tee -a "$DIR/log.txt"
  log "$name: $status (rc $rc) in $secs s"
  report
  return "$rc"
}

export COMPASS_REQUIRE_ALL_TIERS=1
export COMPASS_CUDA=ON MAX_JOBS=${MAX_JOBS:-$(nproc)}
# The GPU image's CXX/CUDAHOSTCXX (/opt/gcc wrapper) links libstdc++ statically,
# which makes C++ errors crash Python (setup.py refuses such a module): build
# with the system compiler when there is one.
if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
fi
command -v nvcc >/dev/null || export PATH="$PATH:/usr/local/cuda/bin"

# pytest: verbose, a junit per phase, per-test timeouts by pytest-timeout's thread
# method (a signal cannot interrupt a test stuck in a CUDA call; the thread method
# dumps the stacks and ends the process: under xdist only that worker, which xdist
# reports as a crashed test while the phase goes on). Left out by path: the engines
# (tests/integration, the Megatron ESPO test: not installable on a bare host).
PYTEST=("$PY" -m pytest tests --ignore=tests/integration --ignore=tests/test_espo_loss_megatron.py
  -v -rfE --tb=short -p no:cacheprovider --durations=15
  --timeout "${GPU_CHECK_TEST_TIMEOUT:-60}" -o timeout_method=thread)
XDIST=()
if [ "$DRY" != 1 ]; then
  "$PY" -c "import pytest_timeout" 2>/dev/null ||
    { log "FAIL: pytest-timeout is not installed (the per-test timeouts need it)"; exit 2; }
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
fi
# shellcheck disable=SC2206
EXTRA=(${GPU_CHECK_PYTEST_ARGS:-})

# 1. facts
run_phase facts 60 "$PY" scripts/gpu_report.py --facts "$DIR/facts.json"
# 2. the build, in the background, into build_lib/ (copied in place after the Triton phase)
BUILD_START=$EPOCHREALTIME
BUILD_LIMIT=$(minf 300 "$(left)")
log "build (background, timeout $BUILD_LIMIT s)"
if [ "$DRY" = 1 ]; then
  # shellcheck disable=SC2046
  timeout -k 1 "$BUILD_LIMIT" $(stub_cmd build) >"$DIR/build.log" 2>&1 &
else
  timeout -k 5 "$BUILD_LIMIT" "$PY" setup.py -q build_ext -b "$DIR/build_lib" >"$DIR/build.log" 2>&1 &
fi
BUILD_PID=$!
if [ "${GPU_CHECK_CUT_PHASE:-}" = build ]; then
  CUR_PHASE=build CUR_START=$BUILD_START CUR_LIMIT=$BUILD_LIMIT CUR_PID=$BUILD_PID CUR_ACTIVE=1
  log "injected cut during build"
  kill -TERM $$
fi
# 3. every Triton op once against its reference (on the GPU: Triton compiles for it)
run_phase triton 180 "${PYTEST[@]}" -m "triton and not cutlass and not sm90 and not integration" \
  "${XDIST[@]}" --junitxml="$DIR/junit_triton.xml" "${EXTRA[@]}"
# the build: wait for it (time left), record it, put the module in place
CUR_PHASE=build CUR_START=$BUILD_START CUR_LIMIT=$BUILD_LIMIT CUR_PID=$BUILD_PID CUR_ACTIVE=1
wait "$BUILD_PID"
BUILD_RC=$?
CUR_PID="" BUILD_PID="" CUR_ACTIVE=0
BUILD_S=$(awk -v a="$BUILD_START" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
BUILD_STATUS=passed
[ "$BUILD_RC" != 0 ] && BUILD_STATUS=failed
{ [ "$BUILD_RC" = 124 ] || [ "$BUILD_RC" = 137 ]; } && BUILD_STATUS=timeout
record build "$BUILD_STATUS" "$BUILD_RC" "$BUILD_S" "$BUILD_LIMIT" "setup.py build_ext -b build_lib"
tail -n 15 "$DIR/build.log" | tee -a "$DIR/log.txt"
log "build: $BUILD_STATUS (rc $BUILD_RC) in $BUILD_S s"
if [ "$DRY" != 1 ] && [ "$BUILD_RC" = 0 ]; then
  cp "$DIR"/build_lib/compass_kernels/_C*.so compass_kernels/ || log "FAIL: no module in build_lib"
fi
report
# 4. timings: rows as they come (timing.jsonl), the JSON at the end (timing.json)
run_phase timing 200 "$PY" -m bench.gpu_timing --out "$DIR/timing.json" --jsonl "$DIR/timing.jsonl"
# 5. CUTLASS in its own process, every launch synchronous: a fault is reported at the
# call that made it and cannot poison the tests after it
CUDA_LAUNCH_BLOCKING=1 run_phase cutlass 90 "${PYTEST[@]}" -m cutlass \
  --junitxml="$DIR/junit_cutlass.xml" "${EXTRA[@]}"
# 6. the gpu tier (CUDA backends, no-sync guards, both backends on the device)
run_phase cuda 150 "${PYTEST[@]}" -m "gpu and not cutlass and not triton and not sm90 and not integration" \
  "${XDIST[@]}" --junitxml="$DIR/junit_gpu.xml" "${EXTRA[@]}"
# 7. the rest of the tiers that run on a bare host (unit, sm90 compile checks)
run_phase full 600 "${PYTEST[@]}" -m "not gpu and not triton and not cutlass and not integration" \
  "${XDIST[@]}" --junitxml="$DIR/junit_full.xml" "${EXTRA[@]}"
FINISHED=1
FAILED=$(grep -c -v '"status": "passed"' "$RESULTS")
log "done: $FAILED phase(s) not passed"
[ "$FAILED" = 0 ]
