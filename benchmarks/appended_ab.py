"""The appended schedule's parts under variants (NOTES e31's "what is left"), by device time per
kernel (torch.profiler, the median of several calls) and the whole call timed in turn with the
bare matmul: the floors' bisection steps and warps (`FLOOR_STEPS`, `FLOOR_WARPS`), the sample's
stride (`SAMPLE_STRIDE`: fewer sampled columns, more keys to sort) and margin (`SAMPLE_SIGMAS`).
Every variant must give the same top-k (the keys' values come from the same matmul; only how
many reach the floor changes), up to the ulps of a row redone by cuBLAS where a floor failed.

usage: python benchmarks/appended_ab.py [--k 256,1024]   (one H200)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import llm_like_hidden, time_interleaved_ms, with_attributes  # noqa: E402
from maxima_selection_ab import kernel_times  # noqa: E402
from kd_kernels.ops import topk_from_appended  # noqa: E402
from kd_kernels.teacher_chunked import teacher_topk_appended  # noqa: E402

VARIANTS = {"as is (12 steps, 4 warps, stride 19, 5 sigmas)": {},
            "8 floor steps": dict(FLOOR_STEPS=8),
            "8 warps for the floors": dict(FLOOR_WARPS=8),
            "stride 25": dict(SAMPLE_STRIDE=25),
            "4 sigmas": dict(SAMPLE_SIGMAS=4.0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="256,1024")
    args = parser.parse_args()
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}, entropy {entropy:.2f} nats at τ=1")
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
        print("| variant | both matmuls | floors | key order | sort | whole (in turn) | × first |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        summary, ratios = time_interleaved_ms({"floor": (lambda: hidden @ weight.T, None), **calls})
        for name, (call, _) in calls.items():
            times = kernel_times(call)

            def pick(part):
                return sum(ms for kernel, ms in times.items() if part in kernel)
            print(f"| {name} | {pick('group_maxima'):.3f} | {pick('sample_floor'):.3f} | {pick('order_keys'):.3f} | "
                  f"{pick('sort_keys'):.3f} | {summary[name][0]:.2f} ({ratios[name]:.3f}× the matmul) | "
                  f"{summary[name][0] / summary[next(iter(calls))][0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
