"""The appended schedule's parts under variants (NOTES e31-e35), by device time per kernel
(torch.profiler, the median of several calls) and the whole call timed in turn with the bare
matmul: the CUDA sort (KD_KERNELS_SORT_SELECT: the keys reaching the k-th value selected first,
or all sorted; `SORT_RAW_KEYS`: the matmul's raw keys, or the key order pass first), the
sample's stride (`SAMPLE_STRIDE` with `SAMPLE_COLUMNS_PER_K`: a smaller sample matmul and floors
kernel, more keys) and margin (`SAMPLE_SIGMAS`). Other switches the variants
can set: KD_KERNELS_SORT_REGISTERS, `STORE_APPENDS_IN_PTX`, `FLOOR_STEPS`, `ROW_WARPS`.
First, what the matmul alone costs under the same profiler: cuBLAS, the statistics-only
epilogue matmul, and the appending one with floors no element reaches (its code, no appends).
Every variant must give the same top-k (the keys' values come from the same matmul; only how
many reach the floor changes), up to the ulps of a row redone by cuBLAS where a floor failed.

usage: python benchmarks/appended_ab.py [--k 256,1024] [--matmul-only]   (one H200)
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from harness import (check_variants_agree, environment_variable, kernel_times, print_variant_kernels,  # noqa: E402
                     teacher_s1, time_interleaved_ms, with_attributes)
from kd_kernels.ops import lm_head_group_maxima, topk_from_appended  # noqa: E402
from kd_kernels.ops.lm_head_group_maxima import Appends, EpilogueMatmul  # noqa: E402
from kd_kernels.ops.topk_from_appended import appended_plan, sample_floors  # noqa: E402
from kd_kernels.teacher_chunked import teacher_topk_appended  # noqa: E402

TRITON_STORES = dict(STORE_APPENDS_IN_PTX=False)
PTX_STORES = dict(STORE_APPENDS_IN_PTX=True)
SORTED_AS_IS = {"KD_KERNELS_SORT_REGISTERS": "1", "KD_KERNELS_SORT_SELECT": "1"}
# (the CUDA sort's environment, lm_head_group_maxima settings, topk_from_appended settings)
# the stride at most SAMPLE_STRIDE where the sample keeps SAMPLE_COLUMNS_PER_K · k columns; before
# e34 it was 19 with 8 · k columns: 18 at k = 1024 and V = 151,936
VARIANTS = {"as is (PTX stores, raw keys into a register sort after a selection, 12 steps, 4 warps, stride 50, "
            "5 sigmas)": (SORTED_AS_IS, PTX_STORES, {}),
            "the key order pass first (before e35)": (SORTED_AS_IS, PTX_STORES, dict(SORT_RAW_KEYS=False)),
            "stride 38": (SORTED_AS_IS, PTX_STORES, dict(SAMPLE_STRIDE=38)),
            "register sort of every key": (dict(SORTED_AS_IS, KD_KERNELS_SORT_SELECT="0"), PTX_STORES, {})}


def configured(environment, appends, settings, call):
    """call() under one variant's settings."""
    with ExitStack() as stack:
        for name, value in environment.items():
            stack.enter_context(environment_variable(name, value))
        return with_attributes(lm_head_group_maxima, appends, lambda: with_attributes(
            topk_from_appended, settings, call))


def print_matmul_kernels(hidden, weight):
    """Device ms of the matmul alone, three ways, under the profiler the variants run under."""
    rows, v = hidden.shape[0], weight.shape[0]
    unreached = Appends(torch.full((rows,), float("inf"), device="cuda"),
                        torch.empty(rows, 8, dtype=torch.int64, device="cuda"),
                        torch.zeros(rows, dtype=torch.int32, device="cuda"))
    appending = EpilogueMatmul(hidden, weight, None, v, 2.0, None, appends=unreached)
    matmuls = {"cuBLAS bf16 logits": lambda: hidden @ weight.T,
               "epilogue matmul, statistics only": lambda: EpilogueMatmul(hidden, weight, None, v, 2.0, None)(0, v)}
    for name, settings in (("stores in Triton", TRITON_STORES), ("stores in PTX", PTX_STORES)):
        matmuls[f"appending matmul ({name}), no element reaching its floor"] = (
            lambda settings=settings: with_attributes(lm_head_group_maxima, settings, lambda: appending(0, v)))
    print("| matmul alone | device ms (median of 5) |\n| --- | --- |")
    for name, call in matmuls.items():
        call()
        print(f"| {name} | {sum(kernel_times(call).values()):.3f} |", flush=True)


def print_appending_matmuls_in_turn(hidden, weight, k):
    """The appending matmul alone with the real floors of k, and the statistics-only matmul, timed in turn
    with cuBLAS (25 repetitions: the whole calls' ratios move by ~±5 % from run to
    run, and a Triton matmul's time by ~±4 % from process to process, NOTES e33)."""
    rows, v = hidden.shape[0], weight.shape[0]
    plan = appended_plan(v, k)
    sample = torch.empty(rows, plan.sample_columns, dtype=hidden.dtype, device="cuda")
    EpilogueMatmul(hidden, weight[::plan.stride], None, plan.sample_width, 2.0, sample)(0, plan.sample_width)
    floors = sample_floors(sample[:, :plan.sample_width], plan.rank, torch.empty(rows, device="cuda"))
    del sample
    counts = torch.zeros(rows, dtype=torch.int32, device="cuda")
    keys = torch.empty(rows, plan.capacity, dtype=torch.int64, device="cuda")
    appending = EpilogueMatmul(hidden, weight, None, v, 2.0, None, appends=Appends(floors, keys, counts))
    statistics = EpilogueMatmul(hidden, weight, None, v, 2.0, None)
    def zero_counts():  # a setup: untimed before each call, no arguments for it
        counts.zero_()
        return ()

    calls = {"cuBLAS": (lambda: hidden @ weight.T, None), "statistics only": (lambda: statistics(0, v), None),
             "appending": (lambda: appending(0, v), zero_counts)}
    for fn, setup in calls.values():
        fn()
    summary, ratios = time_interleaved_ms(calls, warmup=2, repeats=25)
    print(f"\n## k = {k}: the matmul alone, the appending one with real floors ({counts.float().mean():.0f} keys "
          f"a row), in turn")
    print("| matmul | ms (median) | × cuBLAS (median of pairs) | device ms, profiler (median of 5) |")
    print("| --- | --- | --- | --- |")
    for name, (fn, setup) in calls.items():
        # the setup's zeroing (a FillFunctor kernel) left out
        profiled = sum(ms for kernel, ms in kernel_times(lambda: (setup and setup(), fn())).items()
                       if "fill" not in kernel.lower())
        print(f"| {name} | {summary[name][0]:.3f} | {ratios[name]:.3f} | {profiled:.3f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="256,1024")
    parser.add_argument("--matmul-only", action="store_true",
                        help="only the matmul alone: unreached floors, then real floors in turn")
    args = parser.parse_args()
    hidden, weight = teacher_s1()
    v = weight.shape[0]
    print_matmul_kernels(hidden, weight)
    for k in [int(part) for part in args.k.split(",")]:
        print_appending_matmuls_in_turn(hidden, weight, k)
        if args.matmul_only:
            continue
        calls = {name: (lambda variant=variant: configured(*variant, lambda: (
            teacher_topk_appended(hidden, weight, k, 2.0, v, select="cuda"))), None)
            for name, variant in VARIANTS.items()}
        check_variants_agree(calls)
        print(f"\n## k = {k}: device ms per kernel (median of 5 calls), whole call in turn")
        print_variant_kernels(calls, lambda: hidden @ weight.T, {"both matmuls": "group_maxima",
                                                                 "floors": "sample_floor", "key order": "order_keys",
                                                                 "sort": "sort_keys", "all kernels": ""})


if __name__ == "__main__":
    main()
