"""Does a call's time depend on the call before it? (issue #4: timed in turn with the floor,
the teacher's from-hidden top-k read 1.20x the matmul at k = 64; each timed in its own block,
1.04-1.09x.) Times (device events, synchronized starts) the floor and ours at k = 64 in the four
orders: each after itself and each after the other, 15 repetitions, medians; and counts the
caching allocator's device allocations (cudaMalloc) during each sequence.

usage: python benchmarks/teacher_order_effect.py
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from harness import elapsed_ms, llm_like_hidden  # noqa: E402


def main():
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, _, _ = llm_like_hidden(n, h, weight)
    calls = {"floor": lambda: hidden @ weight.T,
             "ours k=64": lambda: kd.teacher_topk(hidden, weight, k=64, temperature=2.0, backend="cuda")}
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}")
    print("| timed call | after | median ms | cudaMallocs in the sequence |")
    print("| --- | --- | --- | --- |")
    for timed in calls:
        for before in calls:
            for _ in range(3):
                calls[before]()
                elapsed_ms(calls[timed])
            mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
            times = []
            for _ in range(15):
                elapsed_ms(calls[before])
                times.append(elapsed_ms(calls[timed]))
            mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - mallocs
            print(f"| {timed} | {before} | {statistics.median(times):.2f} | {mallocs} |", flush=True)


if __name__ == "__main__":
    main()
