"""The appended schedule's parts under variants (NOTES e31-e32), by device time per kernel
(torch.profiler, the median of several calls) and the whole call timed in turn with the bare
matmul: how the matmul appends (`APPEND_FORM`: e31's quarters or e32's branch per element in
PTX), the CUDA sort (KD_KERNELS_SORT_REGISTERS: shared memory or registers), the floors'
bisection steps (`FLOOR_STEPS`), the warps of the row kernels (`ROW_WARPS`: floors, key order,
logsumexp), the sample's stride (`SAMPLE_STRIDE`: fewer sampled columns, more keys to sort) and
margin (`SAMPLE_SIGMAS`).
Every variant must give the same top-k (the keys' values come from the same matmul; only how
many reach the floor changes), up to the ulps of a row redone by cuBLAS where a floor failed.

usage: python benchmarks/appended_ab.py [--k 256,1024]   (one H200)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import print_variant_kernels, teacher_s1, with_attributes, with_env  # noqa: E402
from kd_kernels.ops import lm_head_group_maxima, topk_from_appended  # noqa: E402
from kd_kernels.teacher_chunked import teacher_topk_appended  # noqa: E402

# (APPEND_FORM, KD_KERNELS_SORT_REGISTERS, topk_from_appended settings); the first is e31's schedule
VARIANTS = {"e31: quarters, shared-memory sort": ("quarters", "0", {}),
            "appends in PTX": ("asm", "0", {}),
            "PTX + register sort (12 steps, 4 warps, stride 19, 5 sigmas)": ("asm", "1", {}),
            "  + 8 floor steps": ("asm", "1", dict(FLOOR_STEPS=8)),
            "  + 8 warps for the row kernels": ("asm", "1", dict(ROW_WARPS=8)),
            "  + stride 25": ("asm", "1", dict(SAMPLE_STRIDE=25)),
            "  + stride 31": ("asm", "1", dict(SAMPLE_STRIDE=31)),
            "  + 4 sigmas": ("asm", "1", dict(SAMPLE_SIGMAS=4.0))}


def configured(form, sort_registers, settings, call):
    """call() under one variant's settings."""
    return with_env("KD_KERNELS_SORT_REGISTERS", sort_registers, lambda: with_attributes(
        lm_head_group_maxima, dict(APPEND_FORM=form), lambda: with_attributes(topk_from_appended, settings, call)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="256,1024")
    args = parser.parse_args()
    hidden, weight = teacher_s1()
    v = weight.shape[0]
    for k in [int(part) for part in args.k.split(",")]:
        calls = {name: (lambda variant=variant: configured(*variant, lambda: (
            teacher_topk_appended(hidden, weight, k, 2.0, v, select="cuda"))), None)
            for name, variant in VARIANTS.items()}
        first = calls[next(iter(calls))][0]()
        for name, (call, _) in calls.items():
            out = call()
            largest = (out.logprobs - first.logprobs).abs().max().item()
            swapped = (out.indices != first.indices).float().mean().item()
            assert largest < 1e-4 and swapped < 1e-4, (name, largest, swapped)
        print(f"\n## k = {k}: device ms per kernel (median of 5 calls), whole call in turn")
        print_variant_kernels(calls, lambda: hidden @ weight.T, {"both matmuls": "group_maxima",
                                                                 "floors": "sample_floor", "key order": "order_keys",
                                                                 "sort": "sort_keys"})


if __name__ == "__main__":
    main()
