"""The appended schedule's parts under variants (NOTES e31's "what is left"), by device time per
kernel (torch.profiler, the median of several calls) and the whole call timed in turn with the
bare matmul: the floors' bisection steps (`FLOOR_STEPS`), the warps of the row kernels
(`ROW_WARPS`: floors, key order, logsumexp), the sample's stride (`SAMPLE_STRIDE`: fewer sampled
columns, more keys to sort) and margin (`SAMPLE_SIGMAS`).
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

from harness import print_variant_kernels, teacher_s1, with_attributes  # noqa: E402
from kd_kernels.ops import topk_from_appended  # noqa: E402
from kd_kernels.teacher_chunked import teacher_topk_appended  # noqa: E402

VARIANTS = {"as is (12 steps, 4 warps, stride 19, 5 sigmas)": {},
            "8 floor steps": dict(FLOOR_STEPS=8),
            "8 warps for the row kernels": dict(ROW_WARPS=8),
            "stride 25": dict(SAMPLE_STRIDE=25),
            "4 sigmas": dict(SAMPLE_SIGMAS=4.0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="256,1024")
    args = parser.parse_args()
    hidden, weight = teacher_s1()
    v = weight.shape[0]
    for k in [int(part) for part in args.k.split(",")]:
        calls = {name: (lambda settings=settings: with_attributes(topk_from_appended, settings, lambda: (
            teacher_topk_appended(hidden, weight, k, 2.0, v, select="cuda"))), None)
            for name, settings in VARIANTS.items()}
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
