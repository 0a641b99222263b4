"""The maxima schedule's selection kernels under variants (NOTES e27), by device time per kernel
(torch.profiler, the median of several calls: steadier than whole-call ratios) and the whole
call timed in turn: the listing's threshold exact or from a few value-space bisection steps
(`topk_from_group_top2.LISTING_STEPS`), the recompute's hidden step (`HIDDEN_STEP`); since NOTES
e29, T exact or from a few value-space steps (`KTH_STEPS`) and the selection kernels' warps (the
recompute's hidden size in parts and a listed-pairs grid were timed with it too: NOTES e29).

usage: python benchmarks/maxima_selection_ab.py [--k 8,64]   (one H200)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import check_variants_agree, print_variant_kernels, teacher_s1, with_attributes  # noqa: E402
from kd_kernels.ops import topk_from_group_top2 as top2_module  # noqa: E402
from kd_kernels.teacher_chunked import teacher_topk_maxima  # noqa: E402

VARIANTS = {"T exact (32 steps on the bits)": dict(KTH_STEPS=0),
            "T from 8 value-space steps": dict(KTH_STEPS=8),
            "T from 8 steps, 2 warps": dict(KTH_STEPS=8, SELECT_WARPS=2)}
# variants whose sums run in another order (the logsumexp's tiles, the recomputed logits' parts)
REORDERING = ("SELECT_WARPS",)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="8,64")
    args = parser.parse_args()
    hidden, weight = teacher_s1()
    v = weight.shape[0]
    for k in [int(part) for part in args.k.split(",")]:
        calls = {name: (lambda settings=settings: with_attributes(top2_module, settings, lambda: teacher_topk_maxima(
            hidden, weight, k, 2.0, v, select="cuda")), None) for name, settings in VARIANTS.items()}
        # the reordering variants agree up to rounding (4096-term sums in another order): ids swap only at near-ties
        check_variants_agree(calls, exact=[name for name, settings in VARIANTS.items()
                                           if not any(setting in settings for setting in REORDERING)])
        print(f"\n## k = {k}: device ms per kernel (median of 5 calls), whole call in turn")
        print_variant_kernels(calls, lambda: hidden @ weight.T, {"candidates": "candidates",
                                                                 "groups again": "again_group",
                                                                 "ranking": "keys_and_again",
                                                                 "matmul": "group_maxima"})


if __name__ == "__main__":
    main()
