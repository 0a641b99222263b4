"""Tuning of the CUDA top-k kernel (csrc/topk_candidates.cu): time per setting
"steps:kib:radix" = L2 prefetch steps ahead within a row, KiB of the block's next row
(KD_KERNELS_TOPK_PREFETCH) and the radix select before the sort (KD_KERNELS_TOPK_RADIX), on
LLM-like logits (3 nats) at 8192 × 151,936, bf16 and fp32, k ∈ {8, 64, 1024}, and from hidden
(8192 × 4096). Every setting must give the same bits as the first (neither changes a result).

usage: python benchmarks/tune_topk_prefetch.py [--out tune.json]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from harness import environment, llm_like_hidden, time_ms, write_json  # noqa: E402

SETTINGS = ["0:0:0", "0:0:1", "1:0:1", "2:0:1", "4:0:1", "8:0:1", "0:64:1", "2:32:1", "2:64:1", "4:64:1"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="steps:kib:radix, comma-separated")
    args = parser.parse_args()
    settings = args.settings.split(",")
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    logits = {"bf16": hidden @ weight.T}
    logits["fp32"] = logits["bf16"].float()
    copy_ms = time_ms(lambda: logits["bf16"].clone())[0]
    copy_gbs = 2 * logits["bf16"].numel() * 2 / copy_ms / 1e6
    matmul_ms = time_ms(lambda: hidden @ weight.T)[0]
    print(f"entropy {entropy:.2f} nats; copy {copy_gbs:.0f} GB/s; matmul {matmul_ms:.2f} ms")
    cases = [(dtype, k) for dtype in ("bf16", "fp32") for k in (8, 64, 1024)]
    rows, reference = [], {}
    for setting in settings:
        steps, kib, radix = setting.split(":")
        os.environ["KD_KERNELS_TOPK_PREFETCH"] = f"{steps},{kib}"
        os.environ["KD_KERNELS_TOPK_RADIX"] = radix
        row = dict(setting=setting)
        for dtype, k in cases:
            fn = lambda: kd.teacher_topk_from_logits(logits[dtype], k=k, backend="cuda")  # noqa: E731
            result = fn()
            if (dtype, k) in reference:
                expected = reference[(dtype, k)]
                assert torch.equal(result.indices, expected.indices) and torch.equal(result.logprobs,
                                                                                     expected.logprobs), setting
            else:
                reference[(dtype, k)] = result
            ms = time_ms(fn, warmup=3, repeats=15)[0]
            row[f"{dtype} k={k}"] = 100 * logits[dtype].numel() * logits[dtype].element_size() / ms / 1e6 / copy_gbs
        for k in (64, 1024):
            ms = time_ms(lambda: kd.teacher_topk(hidden, weight, k=k, backend="cuda"), warmup=2, repeats=7)[0]
            row[f"hidden k={k}"] = ms / matmul_ms
        rows.append(row)
        print(row, flush=True)
    columns = [f"{d} k={k}" for d, k in cases]
    print("| steps:KiB:radix | " + " | ".join(f"{c} % of copy" for c in columns) + " | from hidden k=64 × mm | k=1024 × mm |")
    print("|" + " --- |" * (len(columns) + 3))
    for row in rows:
        print(f"| {row['setting']} | " + " | ".join(f"{row[c]:.1f}" for c in columns)
              + f" | {row['hidden k=64']:.3f} | {row['hidden k=1024']:.3f} |")
    if args.out:
        write_json(args.out, dict(environment=environment(), copy_gbs=copy_gbs, matmul_ms=matmul_ms, rows=rows))


if __name__ == "__main__":
    main()
