#!/usr/bin/env bash
# One GPU-machine call: GPU tests, then the student benchmark; logs and JSON under $OUT.
# usage (device tool): source .devpkgs/device-env.sh && bash benchmarks/gpu_run.sh [TEST_ARGS] [BENCH_ARGS]
set -uo pipefail
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  python -m pytest -q -m "${TEST_MARKERS:-gpu or interpret}" tests/ ${TEST_ARGS:-} 2>&1 | tail -25 | tee "$OUT/tests.log"
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  python benchmarks/bench_topk_divergence.py ${BENCH_ARGS:-} --out "$OUT/bench_topk_divergence.json" 2>&1 | tee "$OUT/bench.log"
fi
if [ "${RUN_TEACHER:-0}" = 1 ]; then
  python benchmarks/bench_teacher_topk.py ${TEACHER_ARGS:-} --out "$OUT/bench_teacher_topk.json" 2>&1 | tee "$OUT/bench_teacher.log"
fi
