#!/usr/bin/env bash
# One GPU-machine call: build the CUDA extension, GPU tests, then the benchmarks chosen by
# the flags below; logs and JSON under $OUT.
# usage (device tool): source .devpkgs/device-env.sh && [FLAGS] bash benchmarks/gpu_run.sh
#   BUILD_CUDA=1   build kd_kernels._C with the documented command and use it in place
#   RUN_TESTS=1    pytest -m "$TEST_MARKERS" (default "gpu or interpret") $TEST_ARGS ($TEST_PATHS, default tests/)
#   RUN_BENCH=1    benchmarks/bench_topk_divergence.py $BENCH_ARGS (the student)
#   RUN_TEACHER=0  benchmarks/bench_teacher_topk.py $TEACHER_ARGS
#   RUN_TP2=0      two GPUs: the TP = 2 Megatron example and bench_vocab_parallel.py
#   RUN_E2E=0      the driver: bench_e2e_throughput.py and the quality check bench_e2e.py
set -uo pipefail
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if [ "${BUILD_CUDA:-1}" = 1 ]; then
  ( time KD_KERNELS_BUILD_CUDA=1 python -m pip install --no-build-isolation --no-deps --no-index . ) \
    > "$OUT/pip_install.log" 2>&1 || { echo "CUDA build failed"; tail -30 "$OUT/pip_install.log"; }
  so=$(cd /tmp && python -c "import importlib.util as u; print(u.find_spec('kd_kernels._C').origin)" 2>/dev/null)
  [ -n "$so" ] && cp "$so" kd_kernels/ && echo "built $so"
fi
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout "${TESTS_TIMEOUT:-400}" python -m pytest -q -m "${TEST_MARKERS:-gpu or interpret}" ${TEST_PATHS:-tests/} \
    ${TEST_ARGS:-} > "$OUT/tests.log" 2>&1
  tail -25 "$OUT/tests.log"
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  python benchmarks/bench_topk_divergence.py ${BENCH_ARGS:-} --out "$OUT/bench_topk_divergence.json" 2>&1 | tee "$OUT/bench.log"
fi
if [ "${RUN_TEACHER:-0}" = 1 ]; then
  python benchmarks/bench_teacher_topk.py ${TEACHER_ARGS:-} --out "$OUT/bench_teacher_topk.json" 2>&1 | tee "$OUT/bench_teacher.log"
fi
if [ "${RUN_TP2:-0}" = 1 ]; then
  torchrun --nproc_per_node 2 examples/megatron_tp2_distill.py > "$OUT/example_tp2.log" 2>&1; tail -4 "$OUT/example_tp2.log"
  torchrun --nproc_per_node 2 benchmarks/bench_vocab_parallel.py --out "$OUT/bench_vocab_parallel.json" \
    > "$OUT/bench_vp.log" 2>&1; tail -8 "$OUT/bench_vp.log"
fi
if [ "${RUN_E2E:-0}" = 1 ]; then
  timeout "${E2E_TIMEOUT:-330}" python benchmarks/bench_e2e_throughput.py --profile ${E2E_ARGS:-} \
    --out "$OUT/e2e_throughput.json" > "$OUT/e2e_throughput.log" 2>&1
  grep -v Warn "$OUT/e2e_throughput.log" | tail -8
  timeout "${QUALITY_TIMEOUT:-300}" python benchmarks/bench_e2e.py --set output_dir=/tmp/e2e \
    > "$OUT/e2e_quality.log" 2>&1; grep -v "logging.cc" "$OUT/e2e_quality.log" | tail -4
fi
