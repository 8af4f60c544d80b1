#!/bin/bash
# compass-rl stage-0 ablation on the same seeds: uniform N, reactive resample,
# allocation, allocation + resample (then allocation under a token budget).
# Usage: bash docs/perf/budget_ablation.sh OUT_DIR   (run from the repo root)
OUT=${1:-/tmp/budget_ablation}
mkdir -p "$OUT"
PY=${PY:-python}
STEPS=${STEPS:-3}
COMMON="--steps $STEPS --pool 8 --prompts 8 --n 4 --seed 0 --dp 1 --no-plot --reward-latency-ms 5"
run() {
  name=$1; shift; start=$(date +%s)
  $PY -m compass_kernels.integration.rl.loop $COMMON --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - start ))s $(date -u +%H:%M:%S)" >> "$OUT/done.txt"
}
run uniform --resample-budget 0
run resample
run allocate --allocate samples --resample-budget 0
run allocate_resample --allocate samples
run allocate_tokens --allocate tokens --resample-budget 0
