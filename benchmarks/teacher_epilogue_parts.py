"""Where the epilogue schedule's time goes (issue #4): the matmul with row summaries per chunk,
and the top-k from group maxima per chunk at several launch widths, against cuBLAS. (The
parts of the listed and sliced schedules, since removed, were timed here: benchmarks/NOTES.md.)

``--top2``: the matmul storing no logits but each group's top two; ``--maxima``: the maxima
schedule's parts (that matmul, the selection).

usage: python benchmarks/teacher_epilogue_parts.py [--selection-only | --store | --top2 | --maxima]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import llm_like_hidden, time_ms, with_attributes  # noqa: E402
from kd_kernels.ops import topk_from_groups as groups_module  # noqa: E402
from kd_kernels.ops.lm_head_group_maxima import (  # noqa: E402
    GroupMaximaConfig, lm_head_logits_with_summaries, padded_width)

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

    return lambda: with_attributes(groups_module, settings, lambda: groups_module.topk_from_group_maxima(
        logits, summaries, k, TEMPERATURE, width, order))


def store_parts(hidden, weight, rows):
    """What the default schedule's float32 store costs: the epilogue matmul over 2048-row chunks
    of the whole vocabulary storing float32, float16 (half the bytes; a probe: the schedule
    stores float32) or no logits."""
    from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul, row_tile_descriptor

    n, v = hidden.shape[0], weight.shape[0]
    chunk = 2048
    logits32 = torch.empty(chunk, padded_width(v), device="cuda")
    logits16 = torch.empty(chunk, padded_width(v), device="cuda", dtype=torch.float16)
    for what, buffer in (("float32", logits32), ("float16", logits16), ("no", None)):
        matmuls = []
        for start in range(0, n, chunk):
            matmul = EpilogueMatmul(hidden[start:start + chunk], weight, None, v, TEMPERATURE,
                                    None if buffer is None else logits32)
            if buffer is logits16:
                matmul.logits_desc = row_tile_descriptor(logits16[:, :v], "logits", [128, 128], "the probe")
            matmuls.append(matmul)
        rows.append((f"epilogue matmul, {chunk}-row chunks of the whole vocabulary, {what} logits stored",
                     time_ms(lambda: [matmul(0, v) for matmul in matmuls])[0]))
        print(rows[-1], flush=True)


def top2_parts(hidden, weight, rows):
    """What the maxima schedule's matmul costs: the epilogue matmul over chunks of the whole
    vocabulary storing float32 logits (the default schedule), nothing, or nothing but each
    group's maximum column and second largest too (3 or 4 stages)."""
    from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul

    n, v = hidden.shape[0], weight.shape[0]
    for chunk in (2048, 1024):
        logits = torch.empty(chunk, padded_width(v), device="cuda") if chunk == 2048 else None
        variants = [("float32 logits stored", logits, False, 3)] if logits is not None else []
        variants += [("no logits", None, False, 3), ("no logits, group top-2", None, True, 3),
                     ("no logits, group top-2, 4 stages", None, True, 4)]
        for what, buffer, top2, stages in variants:
            config = GroupMaximaConfig(num_stages=stages)
            matmuls = [EpilogueMatmul(hidden[start:start + chunk], weight, None, v, TEMPERATURE, buffer, config, top2)
                       for start in range(0, n, chunk)]
            rows.append((f"epilogue matmul, {chunk}-row chunks, {what}",
                         time_ms(lambda: [matmul(0, v) for matmul in matmuls])[0]))
            print(rows[-1], flush=True)
            matmuls = None


def maxima_parts(hidden, weight, rows):
    """The maxima schedule's parts per chunk (the matmul with group top-2, the selection),
    scaled to all rows, the groups it computes again per row, and the whole of it."""
    from kd_kernels.ops.topk_from_group_top2 import topk_from_group_top2
    from kd_kernels.teacher_chunked import maxima_chunk_rows, teacher_topk_maxima

    n, v = hidden.shape[0], weight.shape[0]
    for k in (8, 64, 256):
        chunk = maxima_chunk_rows(n, v, k)
        part, scale = hidden[:chunk], n / chunk
        summaries = lm_head_logits_with_summaries(part, weight, None, v, TEMPERATURE, None, group_top2=True)
        rows.append((f"k={k}, {chunk} rows: matmul with group top-2 (× {scale:.2f})", scale * time_ms(
            lambda: lm_head_logits_with_summaries(part, weight, None, v, TEMPERATURE, None, group_top2=True))[0]))
        rows.append((f"k={k}: selection (× {scale:.2f})", scale * time_ms(
            lambda: topk_from_group_top2(part, weight, None, summaries, k, TEMPERATURE, v, order="cuda"))[0]))
        kth = summaries.group_max.topk(k, dim=-1).values[:, -1:]
        again = ((summaries.group_max >= kth) & (summaries.group_second >= kth)).sum(-1).float()
        rows.append((f"  k={k}: groups computed again a row: mean {again.mean().item():.2f}, max "
                     f"{again.max().item():.0f}", 0.0))
        rows.append((f"k={k}: the whole maxima schedule", time_ms(lambda: teacher_topk_maxima(
            hidden, weight, k, TEMPERATURE, v, select="cuda"))[0]))
        print(*rows[-4:], sep="\n", flush=True)
        summaries = None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selection-only", action="store_true", help="skip the matmul parts")
    parser.add_argument("--store", action="store_true", help="the float32 store's cost only (with float16, none)")
    parser.add_argument("--top2", action="store_true", help="the matmul with each group's top two, no logits")
    parser.add_argument("--maxima", action="store_true", help="the maxima schedule's parts only")
    args = parser.parse_args()
    selection_only = args.selection_only
    n, h, v = 8192, 4096, 151936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    rows = []
    full = time_ms(lambda: hidden @ weight.T)[0]
    rows.append(("cuBLAS bf16, 8192 rows", full))
    rows.append(("cuBLAS fp32 out, 8192 rows", time_ms(lambda: torch.mm(hidden, weight.T, out_dtype=torch.float32))[0]))
    if args.store or args.top2 or args.maxima:
        parts = store_parts if args.store else top2_parts if args.top2 else maxima_parts
        parts(hidden, weight, rows)
        print_table(rows, full, n, h, v, entropy)
        return
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
    print_table(rows, full, n, h, v, entropy)


def print_table(rows, full, n, h, v, entropy):
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}, entropy {entropy:.2f} nats at τ=1")
    print("| part | ms for 8192 rows | × cuBLAS bf16 |")
    print("| --- | --- | --- |")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {ms / full:.3f} |")


if __name__ == "__main__":
    main()
