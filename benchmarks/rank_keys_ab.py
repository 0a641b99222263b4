"""The appended schedule's per-row ranking (kd_kernels/ops/sort_keys.py `top_of_counted_keys`)
by order, on the keys a real appending matmul kept (8192 rows, Qwen-like S1, the floors of k):
the extension's sort ("cuda") against the Triton kernels ("triton" with `TRITON_RANKING`
"select": bisection to the k-th key, then a sort of k; "topk": a top-k network over every
slot). (At 3b1ca1f it also timed two bits a step, NOTES e37.)
Device events, median (p20-p80) of 25 calls after 3 warm-ups; every order must give the same
values and columns bit for bit.

usage: python benchmarks/rank_keys_ab.py [--k 8,64,256,1024]   (one GPU)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from harness import teacher_s1, time_ms, with_attributes  # noqa: E402
from kd_kernels.ops import sort_keys  # noqa: E402
from kd_kernels.ops.lm_head_group_maxima import Appends, EpilogueMatmul  # noqa: E402
from kd_kernels.ops.topk_from_appended import appended_plan, sample_floors  # noqa: E402


TRITON_VARIANTS = {"triton select": dict(TRITON_RANKING="select"), "triton topk": dict(TRITON_RANKING="topk")}


def appended_keys(hidden, weight, k):
    """(raw keys ``[N, capacity]`` int64, counts ``[N]`` int32 clamped to the capacity) of the
    appended schedule at k over all of ``hidden``'s rows."""
    rows, width = hidden.shape[0], weight.shape[0]
    plan = appended_plan(width, k)
    sample = torch.empty(rows, plan.sample_columns, dtype=hidden.dtype, device="cuda")
    EpilogueMatmul(hidden, weight[::plan.stride], None, plan.sample_width, 1.0, sample)(0, plan.sample_width)
    floors = sample_floors(sample[:, :plan.sample_width], plan.rank, torch.empty(rows, device="cuda"))
    counts = torch.zeros(rows, dtype=torch.int32, device="cuda")
    keys = torch.empty(rows, plan.capacity, dtype=torch.int64, device="cuda")
    EpilogueMatmul(hidden, weight, None, width, 1.0, None, appends=Appends(floors, keys, counts))(0, width)
    return keys, counts.clamp_(max=plan.capacity)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="8,64,256,1024")
    args = parser.parse_args()
    hidden, weight = teacher_s1()
    print("| k | slots | keys a row (mean, max) | order | ms (p20-p80) | × cuda |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in (int(value) for value in args.k.split(",")):
        keys, counts = appended_keys(hidden, weight, k)
        orders = {"cuda": lambda: sort_keys.top_of_counted_keys(keys, counts, k, "cuda", raw=True)}
        for name, settings in TRITON_VARIANTS.items():
            orders[name] = lambda settings=settings: with_attributes(
                sort_keys, settings, lambda: sort_keys.top_of_counted_keys(keys, counts, k, "triton", raw=True))
        expected = orders["cuda"]()
        cuda_ms = None
        for name, call in orders.items():
            values, columns = call()
            assert torch.equal(values, expected[0]) and torch.equal(columns, expected[1]), name
            median, low, high = time_ms(call, warmup=3, repeats=25)
            cuda_ms = cuda_ms or median
            print(f"| {k} | {keys.shape[1]} | {counts.float().mean():.0f}, {counts.max()} | {name} | "
                  f"{median:.3f} ({low:.3f}-{high:.3f}) | {median / cuda_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
