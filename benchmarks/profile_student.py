"""Where the time of the fused student step goes at S1: torch.profiler kernel table.

usage: python benchmarks/profile_student.py [--lean] [--chunk-rows R]
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


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
