"""The maxima schedule with either group top-2 matmul (KD_KERNELS_TOP2_MATMUL=pingpong: the Hopper
ping-pong kernel, =triton: the Triton epilogue matmul), Qwen-like 8192 × 4096 × 151,936, k = 8
and 64: the device ms of each part of one call (torch.profiler), then the whole call timed in
turn with the bare matmul (NOTES e38).

usage: python benchmarks/top2_matmul_ab.py [--k 8,64]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from harness import check_variants_agree, print_variant_kernels, teacher_s1, with_env  # noqa: E402

PARTS = {"matmul": "lm_head_group", "candidates": "candidates", "groups again": "again",
         "ranking": "topk_of_keys"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="8,64")
    args = parser.parse_args()
    hidden, weight = teacher_s1()
    for k in map(int, args.k.split(",")):
        calls = {f"{matmul} top-2 matmul, k = {k}": (
            lambda matmul=matmul: with_env("KD_KERNELS_TOP2_MATMUL", matmul,
                                           lambda: kd.teacher_topk(hidden, weight, k=k, temperature=2.0,
                                                                   backend="cuda")), None)
            for matmul in ("pingpong", "triton")}
        check_variants_agree(calls)
        print_variant_kernels(calls, lambda: hidden @ weight.T, PARTS)


if __name__ == "__main__":
    main()
