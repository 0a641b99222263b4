"""Is the teacher's time over the bare matmul spent on the device or in the host's launches?

Times (device events, median of 10) the bare matmul and ``kd.teacher_topk`` from hidden, alone
(timing starts before the host has launched anything: its Python work before the first kernel
counts) and behind a 3 ms device sleep (the host launches while the device is busy, as in a
training step, where the teacher's forward runs before its lm_head), the sleep subtracted.

usage: python benchmarks/teacher_host_gap.py [--schedule epilogue,sliced] [--k 8,64]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from harness import llm_like_hidden, time_ms, with_env  # noqa: E402

SLEEP_CYCLES = 5_000_000


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="", help="comma-separated KD_KERNELS_TEACHER_SCHEDULE values "
                                                       "(default: the default schedule only)")
    parser.add_argument("--k", default="8,64", help="comma-separated")
    args = parser.parse_args()
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, _, _ = llm_like_hidden(n, h, weight)
    sleep = time_ms(lambda: torch.cuda._sleep(SLEEP_CYCLES))[0]
    calls = {"floor: lm_head matmul": lambda: hidden @ weight.T}
    for schedule in args.schedule.split(",") if args.schedule else [""]:
        for k in [int(part) for part in args.k.split(",")]:
            calls[f"ours from hidden (cuda{', ' + schedule if schedule else ''}), k={k}"] = (
                lambda k=k, schedule=schedule: with_env("KD_KERNELS_TEACHER_SCHEDULE", schedule or None, lambda: (
                    kd.teacher_topk(hidden, weight, k=k, temperature=2.0, backend="cuda"))))
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}; sleep {sleep:.2f} ms")
    print("| call | alone ms | behind the sleep ms (sleep subtracted) |")
    print("| --- | --- | --- |")
    for name, call in calls.items():
        alone = time_ms(call)[0]
        behind = time_ms(lambda: (torch.cuda._sleep(SLEEP_CYCLES), call()))[0] - sleep
        print(f"| {name} | {alone:.2f} | {behind:.2f} |", flush=True)


if __name__ == "__main__":
    main()
