"""What the float32 output of the lm_head matmul costs (the fused student and the teacher write
their logits chunks in float32): cuBLAS through torch with float32 out against bf16 out, per
chunk, by BLAS library and layout, timed in turn within each repetition.

usage: python benchmarks/fp32_logits_matmul.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import environment, time_interleaved_ms  # noqa: E402


def with_library(name, fn):
    def run():
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(name)
        try:
            fn()
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return run


def shape_calls(rows, h, v):
    hidden = (torch.randn(rows, h, device="cuda")).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    out = torch.empty(rows, v, device="cuda")
    out_t = torch.empty(v, rows, device="cuda")
    fp32 = lambda: torch.mm(hidden, weight.T, out_dtype=torch.float32, out=out)  # noqa: E731
    return {
        "bf16 out": (lambda: hidden @ weight.T, None),
        "fp32 out": (fp32, None),
        "fp32 out, cublas": (with_library("cublas", fp32), None),
        "fp32 out, cublaslt": (with_library("cublaslt", fp32), None),
        "fp32 out, transposed [V, R]": (lambda: torch.mm(weight, hidden.T, out_dtype=torch.float32, out=out_t), None),
    }


def main():
    print(f"environment: {environment()}")
    for rows, h, v in ((2048, 2048, 151_936), (1024, 2048, 151_936), (4096, 2048, 151_936), (2208, 4096, 151_936)):
        try:
            calls = shape_calls(rows, h, v)
            summary, ratios = time_interleaved_ms(calls, warmup=3, repeats=15)
        except Exception as error:  # noqa: BLE001
            print(f"{rows}x{h}x{v}: failed {error!r}")
            continue
        print(f"\n## {rows} × {h} × {v}")
        print("| variant | ms (p20–p80) | × bf16 out (median of pairs) | TFLOP/s |")
        print("| --- | --- | --- | --- |")
        for name, (median, low, high) in summary.items():
            print(f"| {name} | {median:.3f} ({low:.3f}–{high:.3f}) | {ratios[name]:.3f} | "
                  f"{2 * rows * h * v / median / 1e9:.0f} |")
        for name, (fn, _) in calls.items():  # which kernel each one runs
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
                fn()
                torch.cuda.synchronize()
            kernels = [e.name[:70] for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"  {name}: {kernels[:2]}")


if __name__ == "__main__":
    main()
