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
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import llm_like_hidden, time_interleaved_ms, with_attributes  # noqa: E402
from kd_kernels.ops import topk_from_group_top2 as top2_module  # noqa: E402
from kd_kernels.teacher_chunked import teacher_topk_maxima  # noqa: E402

VARIANTS = {"T exact (32 steps on the bits)": dict(KTH_STEPS=0),
            "T from 8 value-space steps": dict(KTH_STEPS=8),
            "T from 8 steps, 2 warps": dict(KTH_STEPS=8, SELECT_WARPS=2)}
# variants whose sums run in another order (the logsumexp's tiles, the recomputed logits' parts)
REORDERING = ("SELECT_WARPS",)


def kernel_times(call, repeats=5):
    """{kernel name: median over ``repeats`` calls of its summed device time in ms}."""
    samples = defaultdict(list)
    for _ in range(repeats):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            call()
            torch.cuda.synchronize()
        totals = defaultdict(float)
        for event in profiler.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] += event.device_time_total / 1000
        for name, total in totals.items():
            samples[name].append(total)
    return {name: statistics.median(values) for name, values in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="8,64")
    args = parser.parse_args()
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}, entropy {entropy:.2f} nats at τ=1")
    for k in [int(part) for part in args.k.split(",")]:
        calls = {name: (lambda settings=settings: with_attributes(top2_module, settings, lambda: teacher_topk_maxima(
            hidden, weight, k, 2.0, v, select="cuda")), None) for name, settings in VARIANTS.items()}
        first = calls[next(iter(calls))][0]()
        for name, (call, _) in calls.items():
            out = call()
            if not any(setting in VARIANTS[name] for setting in REORDERING):
                assert torch.equal(out.indices, first.indices) and torch.equal(out.logprobs, first.logprobs), name
            else:  # the same up to rounding (4096-term sums in another order): ids swap only at near-ties
                largest = (out.logprobs - first.logprobs).abs().max().item()
                swapped = (out.indices != first.indices).float().mean().item()
                print(f"{name}: log-probs within {largest:.2e} of the first variant's, ids swapped {swapped:.2e}")
                assert largest < 1e-4 and swapped < 1e-4, name
        print(f"\n## k = {k}: device ms per kernel (median of 5 calls), whole call in turn")
        print("| variant | candidates | groups again | ranking | matmul | whole (in turn) | × first |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        summary, ratios = time_interleaved_ms({"floor": (lambda: hidden @ weight.T, None), **calls})
        for name, (call, _) in calls.items():
            times = kernel_times(call)

            def pick(part):
                return sum(ms for kernel, ms in times.items() if part in kernel)
            print(f"| {name} | {pick('candidates'):.3f} | {pick('again_group'):.3f} | {pick('keys_and_again'):.3f} | "
                  f"{pick('group_maxima'):.3f} | {summary[name][0]:.2f} ({ratios[name]:.3f}× the matmul) | "
                  f"{summary[name][0] / summary[next(iter(calls))][0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
