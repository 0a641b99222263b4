"""A/B of a switch of a CUDA kernel inside one teacher schedule from hidden states (``--schedule``:
``tiled``, `teacher_topk_tiled`, the CUDA top-k on 1024-row × 12,288-column float32 tiles, short
rows it was not tuned for; ``epilogue``, the default past k = 256, whose CUDA gather sorts the
candidates; ``appended``, `lean=True`'s past k = 64, whose CUDA sort ranks the keys), the two
settings and the bare matmul timed in turn within each repetition, at 8192 × 4096 × 151,936.

usage: python benchmarks/lean_select_ab.py --switch KD_KERNELS_TOPK_NARROW [--values 0,1] [--ks 8,64,1024]
       [--schedule tiled|epilogue|appended]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kd_kernels.teacher_chunked import (teacher_topk_appended, teacher_topk_epilogue,  # noqa: E402
                                       teacher_topk_tiled)
from harness import environment, llm_like_hidden, time_interleaved_ms, with_env  # noqa: E402
from teacher_select_ab import switch_parser  # noqa: E402

TEMPERATURE = 2.0
SCHEDULES = {"tiled": teacher_topk_tiled, "epilogue": teacher_topk_epilogue, "appended": teacher_topk_appended}


def main():
    parser = switch_parser(__doc__, repeats=9)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="tiled")
    args = parser.parse_args()
    schedule = SCHEDULES[args.schedule]
    value_a, value_b = args.values.split(",")
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    print(f"environment: {environment()}; N={n} H={h} V={v}, entropy {entropy:.2f} nats at τ=1; "
          f"schedule {args.schedule}; A: {args.switch}={value_a}, B: {args.switch}={value_b}")
    print("| k | matmul ms | A ms | B ms | A / matmul | B / matmul | B / A (medians) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k in [int(x) for x in args.ks.split(",")]:
        def lean(choice, k=k):
            return lambda: with_env(args.switch, choice, lambda: schedule(
                hidden, weight, k, TEMPERATURE, v, select="cuda"))
        calls = {"matmul": (lambda: hidden @ weight.T, None), "A": (lean(value_a), None), "B": (lean(value_b), None)}
        summary, ratios = time_interleaved_ms(calls, warmup=2, repeats=args.repeats)
        a, b = (summary[label][0] for label in ("A", "B"))
        print(f"| {k} | {summary['matmul'][0]:.2f} | {a:.2f} | {b:.2f} | {ratios['A']:.3f} | {ratios['B']:.3f} | "
              f"{b / a:.3f} |", flush=True)


if __name__ == "__main__":
    main()
