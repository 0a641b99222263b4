"""Where the time of the fused student step goes at S1: torch.profiler kernel table.

usage: python benchmarks/profile_student.py [--lean] [--chunk-rows R] [--passes two,one,cluster]
(--passes: one kernel table per KD_KERNELS_STUDENT_PASSES, ms per step, and the step's device time)
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from bench_topk_divergence import teacher_topk_dense  # noqa: E402
from harness import llm_like_hidden  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--lean", action="store_true")
parser.add_argument("--chunk-rows", type=int, default=None)
parser.add_argument("--passes", default="", help="comma-separated KD_KERNELS_STUDENT_PASSES values (default: as set)")
args = parser.parse_args()
n, h, v, k = 8192, 2048, 151_936, 64
weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
hidden, _, _ = llm_like_hidden(n, h, weight.detach())
teacher, *_ = teacher_topk_dense(n, h, v, k)
labels = torch.randint(0, v, (n,), device="cuda")


def step():
    x = hidden.detach().requires_grad_()
    kd.topk_divergence(x, weight, teacher, labels, ce_weight=1.0, check_values=False, backend="triton",
                      lean=args.lean, chunk_rows=args.chunk_rows).backward()
    weight.grad = None


STEPS = 5


def profile_steps(label):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        step()
    stop.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    busy = sum(e.self_device_time_total for e in events) / STEPS / 1e3
    print(f"## {label}: {start.elapsed_time(stop) / STEPS:.2f} ms a step (events), kernels {busy:.2f} ms")
    for event in events[:10]:
        if event.self_device_time_total:
            print(f"  {event.self_device_time_total / STEPS / 1e3:7.3f} ms  {event.count // STEPS:4d}×  {event.key[:90]}")


for passes in [p for p in args.passes.split(",") if p] or [os.environ.get("KD_KERNELS_STUDENT_PASSES", "one")]:
    # "cluster16": the CUDA row pass with 16 CTAs a row
    os.environ["KD_KERNELS_STUDENT_PASSES"] = passes.rstrip("0123456789")
    os.environ["KD_KERNELS_ROW_PASS_CLUSTER"] = passes[len("cluster"):] if passes.startswith("cluster1") else "8"
    profile_steps(f"passes={passes}, lean={args.lean}, chunk_rows={args.chunk_rows}")
