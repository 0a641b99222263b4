"""The appending matmul alone, e32 (an atomic a row and tile reserves the slots: the tile waits
for its result; ab_sources/lm_head_group_maxima_e32.py, the module as it was at 5bff996^)
against e33 (each program logs its own entries, no atomic; kd_kernels/ops/lm_head_group_maxima.py),
with the real floors of k = 1024 at 8192 × 4096 × 151,936, in one process: timed in turn with
cuBLAS and the statistics-only matmul (device events, median of the repetitions' ratios), then
per kernel under the profiler. Both keep the same elements (their mean entries a row printed).

usage: python benchmarks/append_log_ab.py   (one H200)
"""
from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from harness import environment, kernel_times, teacher_s1, time_interleaved_ms  # noqa: E402
from kd_kernels.ops import lm_head_group_maxima as e33  # noqa: E402
from kd_kernels.ops.topk_from_appended import appended_plan, log_capacity, sample_floors  # noqa: E402

K = 1024


def load_e32():
    """The e32 module, imported beside the package's own (its relative imports resolve there)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ab_sources", "lm_head_group_maxima_e32.py")
    spec = importlib.util.spec_from_file_location("kd_kernels.ops._lm_head_group_maxima_e32", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main():
    e32 = load_e32()
    hidden, weight = teacher_s1()
    rows, v = hidden.shape[0], weight.shape[0]
    print(f"environment: {environment()}; k = {K}")
    plan = appended_plan(v, K)
    sample = torch.empty(rows, plan.sample_columns, dtype=hidden.dtype, device="cuda")
    e33.EpilogueMatmul(hidden, weight[::plan.stride], None, plan.sample_width, 2.0, sample)(0, plan.sample_width)
    floors = sample_floors(sample[:, :plan.sample_width], plan.rank, torch.empty(rows, device="cuda"))
    del sample
    config = e33.default_config()
    counts = torch.zeros(rows, dtype=torch.int32, device="cuda")
    keys = torch.empty(rows, 4096, dtype=torch.int64, device="cuda")
    reserving = e32.EpilogueMatmul(hidden, weight, None, v, 2.0, None, appends=e32.Appends(floors, keys, counts))
    programs = e33.grid_programs(rows, v, config, hidden.device)
    capacity = log_capacity(plan.entries_a_row, rows, v, programs, config.block_m, config.block_n)
    logs = torch.empty(programs, config.block_m, capacity, dtype=torch.int64, device="cuda")
    log_counts = torch.zeros(programs, config.block_m, dtype=torch.int32, device="cuda")
    seen = torch.zeros(programs, -(-rows // config.block_m), dtype=torch.int8, device="cuda")
    logging = e33.EpilogueMatmul(hidden, weight, None, v, 2.0, None,
                                 appends=e33.Appends(floors, logs, log_counts, seen))
    statistics = e33.EpilogueMatmul(hidden, weight, None, v, 2.0, None)
    calls = {"cuBLAS": (lambda: hidden @ weight.T, None),
             "statistics only": (lambda: statistics(0, v), None),
             "e32: an atomic a row and tile": (lambda: reserving(0, v), lambda: (counts.zero_(), ())[1]),
             "e33: a log a program and row-of-tile": (lambda: logging(0, v), lambda: (seen.zero_(), ())[1])}
    for fn, setup in calls.values():
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    print(f"entries a row: e32 {counts.float().mean():.1f}, e33 {log_counts.sum().item() / rows:.1f}; "
          f"log capacity {capacity}, fullest {int(log_counts.max())}")
    summary, ratios = time_interleaved_ms(calls, warmup=2, repeats=25)
    print("| matmul | ms in turn (median) | × cuBLAS (median of pairs) | device ms, profiler (median of 5) |")
    print("| --- | --- | --- | --- |")
    for name, (fn, setup) in calls.items():
        profiled = sum(ms for kernel, ms in kernel_times(lambda: (setup and setup(), fn())).items()
                       if "zero" not in kernel and "fill" not in kernel)
        print(f"| {name} | {summary[name][0]:.3f} | {ratios[name]:.3f} | {profiled:.3f} |", flush=True)


if __name__ == "__main__":
    main()
