"""Where the time of the teacher top-k goes: torch.profiler kernel table of
`teacher_topk_from_logits` (bf16 logits in memory) and `teacher_topk` (from hidden, lean or
not) at 8192 × 4096 × 151,936, k = 64, for the backend given.

usage: python benchmarks/profile_teacher.py [--backend triton|cuda] [--lean]
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from harness import llm_like_hidden  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--lean", action="store_true")
    parser.add_argument("--k", type=int, default=64)
    args = parser.parse_args()
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, _, _ = llm_like_hidden(n, h, weight)
    logits = hidden @ weight.T
    calls = {"from bf16 logits": lambda: kd.teacher_topk_from_logits(logits, k=args.k, backend=args.backend),
             "from hidden": lambda: kd.teacher_topk(hidden, weight, k=args.k, backend=args.backend, lean=args.lean)}
    for name, call in calls.items():
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as profiler:
            call()
            torch.cuda.synchronize()
        print(f"## {name}, backend={args.backend}, lean={args.lean}, k={args.k}")
        print(profiler.key_averages().table(sort_by="self_device_time_total", row_limit=10,
                                            max_name_column_width=70))


if __name__ == "__main__":
    main()
