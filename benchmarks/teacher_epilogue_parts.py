"""Where the epilogue schedule's time goes (issue #4): the matmul with row summaries per chunk,
and the top-k from group maxima per chunk at several launch widths, against cuBLAS.

usage: python benchmarks/teacher_epilogue_parts.py [--selection-only]   (one H200; prints a table)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import llm_like_hidden, time_ms  # noqa: E402
from kd_kernels.ops import topk_from_groups as groups_module  # noqa: E402
from kd_kernels.ops.lm_head_group_maxima import lm_head_logits_with_summaries, padded_width  # noqa: E402

TEMPERATURE = 2.0


def selection(logits, summaries, k, width, warps, stages=4, rank_max_k=None, rank_tile=None, order="torch",
              large_k_launch=None, gather_in_cuda=False):
    """The top-k from group maxima with the small-k launch's warps, the kernel's profiling stop,
    the largest k ranked in the kernel (larger: a sort), the large-k rank tile and the large-k
    launch (warps, groups read per step) set."""
    settings = dict(SELECT_WARPS=warps, SELECT_STAGES=stages, RANK_MAX_K=rank_max_k or groups_module.RANK_MAX_K,
                    RANK_TILE=(groups_module.RANK_TILE[0], rank_tile or groups_module.RANK_TILE[1]),
                    GATHER_IN_CUDA=gather_in_cuda)
    if large_k_launch:
        settings.update(SELECT_WARPS_LARGE_K=large_k_launch[0],
                        GROUPS_PER_STEP=(groups_module.GROUPS_PER_STEP[0], large_k_launch[1]))

    def call():
        saved = {name: getattr(groups_module, name) for name in settings}
        for name, value in settings.items():
            setattr(groups_module, name, value)
        try:
            return groups_module.topk_from_group_maxima(logits, summaries, k, TEMPERATURE, width, order)
        finally:
            for name, value in saved.items():
                setattr(groups_module, name, value)
    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selection-only", action="store_true", help="skip the matmul parts")
    selection_only = parser.parse_args().selection_only
    n, h, v = 8192, 4096, 151936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    rows = []
    full = time_ms(lambda: hidden @ weight.T)[0]
    rows.append(("cuBLAS bf16, 8192 rows", full))
    rows.append(("cuBLAS fp32 out, 8192 rows", time_ms(lambda: torch.mm(hidden, weight.T, out_dtype=torch.float32))[0]))
    for chunk in () if selection_only else (2207, 2048, 1024):
        logits = torch.empty(chunk, padded_width(v), device="cuda")
        part = hidden[:chunk]
        ms = time_ms(lambda: lm_head_logits_with_summaries(part, weight, None, v, TEMPERATURE, logits))[0]
        rows.append((f"epilogue matmul, {chunk} rows (× {n / chunk:.2f} = all rows)", ms * n / chunk))
        cublas = time_ms(lambda: torch.mm(part, weight.T, out_dtype=torch.float32))[0]
        rows.append((f"cuBLAS fp32 out, {chunk} rows (× {n / chunk:.2f})", cublas * n / chunk))
    logits = torch.empty(2048, padded_width(v), device="cuda")
    summaries = lm_head_logits_with_summaries(hidden[:2048], weight, None, v, TEMPERATURE, logits)
    variants = [(k, warps, None, None, "torch", None, f"{warps} warps") for k in (8, 64) for warps in (2, 4, 8)]
    variants += [(1024, 8, 1024, (32, 64), "torch", None, "ranked in the kernel, 32 x 64 tiles"),
                 (1024, 8, None, None, "torch", None, "torch sort of the candidates")]
    variants += [(1024, 8, None, None, "cuda", launch, f"CUDA sort, {launch[0]} warps, {launch[1]} groups a step")
                 for launch in ((8, 64), (8, 128), (16, 64), (16, 128), (4, 64), (4, 32))]
    variants += [(1024, 8, None, None, "cuda", "gather", "gathered and sorted in CUDA")]
    for k, warps, rank_max_k, rank_tile, order, launch, what in variants:
        call = selection(logits, summaries, k, v, warps, rank_max_k=rank_max_k, rank_tile=rank_tile, order=order,
                         large_k_launch=None if launch == "gather" else launch, gather_in_cuda=launch == "gather")
        rows.append((f"selection k={k}, {what} (× 4 = all rows)", 4 * time_ms(call)[0]))
        print(rows[-1], flush=True)
        overflow = call()[3].sum().item()
        if overflow:
            rows.append((f"  rows to redo at k={k}: {overflow} of 2048", 0.0))
    for k in (64, 1024):
        for stages, what in ((1, "lse"), (2, "+ threshold"), (3, "+ group list"), (4, "+ gather, ordered")):
            call = selection(logits, summaries, k, v, 4, stages)
            rows.append((f"selection k={k}, stages to {what} (× 4)", 4 * time_ms(call)[0]))
            print(rows[-1], flush=True)
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}, entropy {entropy:.2f} nats at τ=1")
    print("| part | ms for 8192 rows | × cuBLAS bf16 |")
    print("| --- | --- | --- |")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {ms / full:.3f} |")


if __name__ == "__main__":
    main()
