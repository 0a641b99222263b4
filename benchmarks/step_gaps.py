"""Where the GPU waits during one fused student step at S1: the device timeline of the step
(torch.profiler trace), the time before its first kernel, and the largest gaps between kernels
with the kernels around them. A step is timed from a synchronized start, as the benchmark does.

usage: python benchmarks/step_gaps.py [--lean]
"""
import argparse
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from bench_topk_divergence import teacher_topk_dense  # noqa: E402
from harness import llm_like_hidden  # noqa: E402

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
    torch.cuda.synchronize()
    with torch.profiler.record_function("step"):
        kd.topk_divergence(x, weight, teacher, labels, ce_weight=1.0, check_values=False, backend="triton",
                          lean=args.lean).backward()
    torch.cuda.synchronize()


for _ in range(3):
    step()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()
path = os.path.join(tempfile.mkdtemp(), "trace.json")
prof.export_chrome_trace(path)
events = json.load(open(path))["traceEvents"]
kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
step_event = next(e for e in events if e.get("name") == "step" and e.get("cat") == "user_annotation")
start, end = step_event["ts"], kernels[-1]["ts"] + kernels[-1]["dur"]
busy = sum(e["dur"] for e in kernels)
print(f"step (CPU start of the call -> last kernel end): {(end - start) / 1e3:.2f} ms; kernels {busy / 1e3:.2f} ms; "
      f"before the first kernel {(kernels[0]['ts'] - start) / 1e3:.3f} ms; {len(kernels)} kernels")
gaps = [(b["ts"] - (a["ts"] + a["dur"]), a["name"][:50], b["name"][:50]) for a, b in zip(kernels, kernels[1:])]
print(f"gaps between kernels: {sum(g for g, *_ in gaps if g > 0) / 1e3:.3f} ms in all; largest:")
for gap, before, after in sorted(gaps, reverse=True)[:12]:
    print(f"  {gap / 1e3:7.3f} ms  after {before}  before {after}")
cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and start <= e["ts"] <= kernels[0]["ts"]]
print("CPU ops before the first kernel (top by duration):")
for e in sorted(cpu_ops, key=lambda e: -e["dur"])[:10]:
    print(f"  {e['dur'] / 1e3:7.3f} ms  {e['name'][:70]}")
