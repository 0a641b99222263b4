"""Where the GPU waits during one fused student step at S1: the device timeline of the step
(torch.profiler trace), the time before its first kernel, and the largest gaps between kernels
with the kernels around them. A step is timed from a synchronized start, as the benchmark does.

usage: python benchmarks/step_gaps.py [--lean]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from bench_topk_divergence import teacher_topk_dense  # noqa: E402
from harness import llm_like_hidden, print_device_gaps  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--lean", action="store_true")
args = parser.parse_args()
n, h, v, k = 8192, 2048, 151_936, 64
weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
hidden, _, _ = llm_like_hidden(n, h, weight)
teacher, *_ = teacher_topk_dense(n, h, v, k)
labels = torch.randint(0, v, (n,), device="cuda")
labels[torch.rand(n, device="cuda") < 0.05] = -100


def step():
    x = hidden.detach().clone().requires_grad_()
    weight.grad = None
    weight.requires_grad_()
    kd.topk_divergence(x, weight, teacher, labels, ce_weight=1.0, check_values=False, backend="triton",
                       lean=args.lean).backward()


for _ in range(3):
    step()
print_device_gaps(step, "step")
