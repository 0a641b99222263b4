"""A/B of a switch of the CUDA top-k kernel (an environment variable it reads per launch), the
two settings timed in turn within each repetition (so the card's clock and power state falls
on both alike), from bf16 and fp32 logits in memory at the teacher shapes, with a device copy
of the bf16 logits in the same rotation for the bandwidth reference.

usage: python benchmarks/teacher_select_ab.py --switch KD_KERNELS_TOPK_FILTER [--values 0,1] [--ks 8,64,1024]
       [--widths 16384,32768] [--dtypes float32]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from bench_teacher_topk import TEMPERATURE, with_env  # noqa: E402
from harness import environment, llm_like_hidden, time_interleaved_ms  # noqa: E402
from shapes import TEACHER_SHAPES  # noqa: E402


def switch_parser(description, repeats=15):
    """The command line of a switch A/B: --switch NAME, --values A,B, --ks, --repeats."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switch", required=True, help="environment variable the kernel reads")
    parser.add_argument("--values", default="0,1", help="its values for A and B")
    parser.add_argument("--ks", default="8,64,1024")
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def main():
    parser = switch_parser(__doc__)
    parser.add_argument("--widths", default="", help="row lengths to cut the logits to (default: the vocabulary)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    value_a, value_b = args.values.split(",")
    print(f"environment: {environment()}; A: {args.switch}={value_a}, B: {args.switch}={value_b}")
    print("| shape | logits | k | A ms | B ms | B / A (median of pairs) | A % of copy | B % of copy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, n, h, v in TEACHER_SHAPES:
        weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
        hidden, _, _ = llm_like_hidden(n, h, weight)
        logits_bf16 = hidden @ weight.T
        del hidden, weight
        for dtype, width in [(getattr(torch, d), int(w)) for d in args.dtypes.split(",")
                             for w in (args.widths or str(v)).split(",")]:
            logits = logits_bf16[:, :width].to(dtype).contiguous()
            for k in [int(x) for x in args.ks.split(",")]:
                def select(choice, k=k, logits=logits):
                    return lambda: with_env(args.switch, choice, lambda: kd.teacher_topk_from_logits(
                        logits, k=k, temperature=TEMPERATURE, backend="cuda"))
                calls = {"A": (select(value_a), None), "B": (select(value_b), None),
                         "copy": (lambda: logits_bf16.clone(), None)}
                summary, ratios = time_interleaved_ms(calls, warmup=2, repeats=args.repeats)
                copy_gbs = 2 * logits_bf16.numel() * 2 / summary["copy"][0] / 1e6
                share = {label: logits.numel() * logits.element_size() / summary[label][0] / 1e6 / copy_gbs
                         for label in ("A", "B")}
                print(f"| {name}, {logits.shape[1]} columns | {str(dtype)[6:]} | {k} | {summary['A'][0]:.3f} | "
                      f"{summary['B'][0]:.3f} | "
                      f"{ratios['B']:.3f} | {100 * share['A']:.1f} | {100 * share['B']:.1f} |", flush=True)
        logits = logits_bf16 = None  # frees them before the next shape
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
