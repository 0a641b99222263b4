"""Where the teacher's time goes in the benchmark's steady state (issue #4): each call timed as
the benchmark times it (device events from a synchronized start), several repetitions in turn
with the bare matmul, under torch.profiler: per call the event time, the sum of its kernels'
device times, and the kernels by name. The difference between the first two is time the device
waits (for the host, or between kernels); a kernel slower here than alone is the clock's doing.

usage: python benchmarks/teacher_steady_profile.py [--k 64,1024]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from harness import elapsed_ms, llm_like_hidden, with_env  # noqa: E402

REPEATS = 6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="64,1024")
    parser.add_argument("--shape", default="8192,4096,151936")
    args = parser.parse_args()
    n, h, v = (int(x) for x in args.shape.split(","))
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    calls = {"floor: lm_head matmul": lambda: hidden @ weight.T}
    for k in (int(x) for x in args.k.split(",")):
        def ours(k=k):
            return kd.teacher_topk(hidden, weight, k=k, temperature=2.0, backend="cuda")
        for schedule, label in (("epilogue", "epilogue"), ("cublas", "cuBLAS")):
            calls[f"{label} schedule, k={k}"] = (
                lambda schedule=schedule, ours=ours: with_env("KD_KERNELS_TEACHER_SCHEDULE", schedule, ours))
    for fn in calls.values():  # compile, warm the clocks
        for _ in range(2):
            elapsed_ms(fn)
    event_ms = collections.defaultdict(list)
    kernels = {}
    for name, fn in calls.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPEATS):
                event_ms[name].append(elapsed_ms(fn))
        by_kernel = collections.Counter()
        for event in prof.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
                by_kernel[event.key[:60]] += event.self_device_time_total / 1000 / REPEATS
        kernels[name] = by_kernel
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}, entropy {entropy:.2f} nats at τ=1, "
          f"{REPEATS} calls each under the profiler")
    print("| call | event ms (median) | kernels' device ms | waiting ms | kernels (ms per call) |")
    print("| --- | --- | --- | --- | --- |")
    for name in calls:
        median = statistics.median(event_ms[name])
        device = sum(kernels[name].values())
        parts = ", ".join(f"{key} {ms:.3f}" for key, ms in kernels[name].most_common(5))
        print(f"| {name} | {median:.2f} | {device:.2f} | {median - device:.2f} | {parts} |")


if __name__ == "__main__":
    main()
