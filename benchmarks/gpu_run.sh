#!/usr/bin/env bash
# One GPU-machine call: build the CUDA extension, GPU tests, then the runs chosen by the flags
# below, each under its own time limit; logs and JSON under $OUT (8 files at most come back).
# usage (device tool): source .devpkgs/device-env.sh && [FLAGS] bash benchmarks/gpu_run.sh
# Put KD_KERNELS_GIT_SHA=<this checkout's short sha> among the FLAGS: the device copy's .git can be
# stale, and the JSON and logs name their commit from it otherwise.
#   BUILD_CUDA=1   build kd_kernels._C with the documented command and use it in place
#   RUN_TESTS=1    pytest -m "$TEST_MARKERS" (default "gpu") $TEST_PATHS (default tests/); "gpu or interpret"
#                  also runs the interpreter-marked tests natively (the image's numpy 2.4 breaks the Triton 3.6
#                  interpreter, so the one test that forces it, test_vocab_parallel's workers, skips). The whole
#                  GPU suite outlasts TESTS_TIMEOUT=420 (cut after ~130 tests at 4ecfbc3): give it a call
#                  of its own (TESTS_TIMEOUT=530 after the ~55 s build) or split it by TEST_PATHS, or set
#                  TEST_GROUPS="paths;paths;..." to run each group in its own concurrent pytest (logs tests_N.log)
#   RUN_QUALITY=0  benchmarks/bench_e2e.py: distilled vs CE-only student at the GPU defaults
#   RUN_BENCH=1    benchmarks/bench_topk_divergence.py $BENCH_ARGS (the student)
#   RUN_TEACHER=0  benchmarks/bench_teacher_topk.py $TEACHER_ARGS
#   RUN_TP2=0      two GPUs: the TP = 2 Megatron example and bench_vocab_parallel.py
#   RUN_E2E=0      benchmarks/bench_e2e_throughput.py $E2E_ARGS (the driver's layouts vs one process)
#   RUN_PARTS=0    benchmarks/teacher_epilogue_parts.py $PARTS_ARGS (e.g. --maxima, --selection-only)
# *_ARGS are evaluated by the shell (quote names with spaces inside them); *_TIMEOUT in seconds.
set -uo pipefail
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
if [ "${BUILD_CUDA:-1}" = 1 ]; then
  ( time KD_KERNELS_BUILD_CUDA=1 python -m pip install --no-build-isolation --no-deps --no-index . ) \
    > /tmp/pip_install.log 2>&1 || { echo "CUDA build failed"; tail -30 /tmp/pip_install.log; }
  so=$(cd /tmp && python -c "import importlib.util as u; print(u.find_spec('kd_kernels._C').origin)" 2>/dev/null)
  [ -n "$so" ] && cp "$so" kd_kernels/ && echo "built $so"
fi
if [ "${RUN_TESTS:-1}" = 1 ] && [ -n "${TEST_GROUPS:-}" ]; then
  # the groups (';'-separated lists of test paths) in concurrent pytest processes on the one GPU: correctness
  # tests only (nothing here is timed), each process its own peak-memory counters
  index=0
  IFS=';' read -ra groups <<< "$TEST_GROUPS"
  for group in "${groups[@]}"; do
    index=$((index + 1))
    timeout -s INT -k 30 "${TESTS_TIMEOUT:-400}" python -m pytest -q -rf --tb=short -m "${TEST_MARKERS:-gpu}" \
      $group > "$OUT/tests_$index.log" 2>&1 &
  done
  wait
  for log in "$OUT"/tests_*.log; do echo "$log: $(tail -1 "$log")"; grep "^FAILED\|^ERROR" "$log" | head -20; done
elif [ "${RUN_TESTS:-1}" = 1 ]; then
  # SIGINT at the limit: pytest stops as on Ctrl-C and still prints its summary, failures named (-rf)
  timeout -s INT -k 30 "${TESTS_TIMEOUT:-400}" python -m pytest -q -rf --tb=short -m "${TEST_MARKERS:-gpu}" \
    ${TEST_PATHS:-tests/} > "$OUT/tests.log" 2>&1
  tail -4 "$OUT/tests.log"
fi
if [ "${RUN_QUALITY:-0}" = 1 ]; then
  timeout "${QUALITY_TIMEOUT:-300}" python benchmarks/bench_e2e.py --set output_dir=/tmp/e2e \
    > "$OUT/e2e_quality.log" 2>&1
  grep -v "logging.cc" "$OUT/e2e_quality.log" | grep "held-out\|Error\|error" | tail -4
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  eval timeout "${BENCH_TIMEOUT:-600}" python benchmarks/bench_topk_divergence.py "${BENCH_ARGS:-}" \
    --out "$OUT/bench_topk_divergence.json" > "$OUT/bench.log" 2>&1
  grep "^|\|^##\|accuracy\|failed" "$OUT/bench.log"
fi
if [ "${RUN_TEACHER:-0}" = 1 ]; then
  eval timeout "${TEACHER_TIMEOUT:-600}" python benchmarks/bench_teacher_topk.py "${TEACHER_ARGS:-}" \
    --out "$OUT/bench_teacher_topk.json" > "$OUT/bench_teacher.log" 2>&1
  grep "^|\|^##\|failed" "$OUT/bench_teacher.log"
fi
if [ "${RUN_TP2:-0}" = 1 ]; then
  torchrun --nproc_per_node 2 examples/megatron_tp2_distill.py > "$OUT/example_tp2.log" 2>&1; tail -4 "$OUT/example_tp2.log"
  torchrun --nproc_per_node 2 benchmarks/bench_vocab_parallel.py --out "$OUT/bench_vocab_parallel.json" \
    > "$OUT/bench_vp.log" 2>&1; tail -8 "$OUT/bench_vp.log"
fi
if [ "${RUN_E2E:-0}" = 1 ]; then
  eval timeout "${E2E_TIMEOUT:-330}" python benchmarks/bench_e2e_throughput.py --profile "${E2E_ARGS:-}" \
    --out "$OUT/e2e_throughput.json" > "$OUT/e2e_throughput.log" 2>&1
  grep -v "Warn\|logging.cc" "$OUT/e2e_throughput.log" | grep "^|\|student step\|GPU"
fi
if [ "${RUN_PARTS:-0}" = 1 ]; then
  eval timeout "${PARTS_TIMEOUT:-300}" python benchmarks/teacher_epilogue_parts.py "${PARTS_ARGS:-}" \
    > "$OUT/teacher_parts.log" 2>&1
  grep "^|\|Error\|error" "$OUT/teacher_parts.log" | tail -40
fi
