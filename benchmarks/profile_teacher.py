"""Where the time of the teacher top-k goes: torch.profiler kernel table of
`teacher_topk_from_logits` (bf16 logits in memory) and `teacher_topk` (from hidden, lean or
not) at 8192 × 4096 × 151,936, k = 64 (or those given), for the backend and schedule given;
then one call's device timeline: the time before its first kernel and the gaps between kernels.

usage: python benchmarks/profile_teacher.py [--backend triton|cuda] [--lean] [--k 8,64]
       [--schedule maxima] [--hidden-only]
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from harness import llm_like_hidden, print_device_gaps  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--lean", action="store_true")
    parser.add_argument("--k", default="64", help="comma-separated")
    parser.add_argument("--schedule", default="", help="sets KD_KERNELS_TEACHER_SCHEDULE (e.g. maxima, epilogue)")
    parser.add_argument("--hidden-only", action="store_true", help="skip the from-logits call")
    args = parser.parse_args()
    if args.schedule:
        os.environ["KD_KERNELS_TEACHER_SCHEDULE"] = args.schedule
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, _, _ = llm_like_hidden(n, h, weight)
    logits = None if args.hidden_only else hidden @ weight.T
    calls = {}
    for k in [int(part) for part in args.k.split(",")]:
        if logits is not None:
            calls[f"from bf16 logits, k={k}"] = lambda k=k: kd.teacher_topk_from_logits(logits, k=k,
                                                                                         backend=args.backend)
        calls[f"from hidden, k={k}"] = lambda k=k: kd.teacher_topk(hidden, weight, k=k, backend=args.backend,
                                                                   lean=args.lean)
    for name, call in calls.items():
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as profiler:
            call()
            torch.cuda.synchronize()
        print(f"## {name}, backend={args.backend}, lean={args.lean}, schedule={args.schedule or 'default'}")
        print(profiler.key_averages().table(sort_by="self_device_time_total", row_limit=10,
                                            max_name_column_width=70))
        print_device_gaps(call, name)


if __name__ == "__main__":
    main()
