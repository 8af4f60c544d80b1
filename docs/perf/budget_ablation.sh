#!/bin/bash
cd /work/wt/budget
export PYTHONPATH=/work/wt/budget
COMMON="--steps 3 --pool 8 --prompts 8 --n 4 --seed 0 --no-plot --reward-latency-ms 5"
run() { name=$1; shift; start=$(date +%s); /work/main/.venv/bin/python -m compass_kernels.integration.rl.loop $COMMON --out /tmp/bud/abl/$name "$@" > /tmp/bud/abl/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-start ))s" >> /tmp/bud/abl/done.txt; }
run uniform --resample-budget 0
run resample
run allocate --allocate samples --resample-budget 0
run allocate_resample --allocate samples
run allocate_tokens --allocate tokens --resample-budget 0
