"""Probe for a lean epilogue schedule (issue #4's ≤ 64 MiB target at speed): the epilogue matmul
(float32 logits + row summaries) over vocab slices of all rows, or over the lean schedule's
row × vocab tiles, against cuBLAS and the default's row chunks; and the top-k from group
maxima per slice (no threshold carried between slices: its upper bound).

usage: python benchmarks/sliced_epilogue_probe.py   (one H200)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import llm_like_hidden, time_ms  # noqa: E402
from kd_kernels.ops.lm_head_group_maxima import lm_head_logits_with_summaries  # noqa: E402
from kd_kernels.ops.topk_from_groups import topk_from_group_maxima  # noqa: E402
from teacher_epilogue_parts import print_table  # noqa: E402

TEMPERATURE = 2.0


def tiled_matmul(hidden, weight, tile_rows, tile_columns, store=True):
    """The epilogue matmul over every (row chunk, vocab slice) tile, one float32 buffer reused."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    buffer = torch.empty(tile_rows, tile_columns, device="cuda") if store else None

    def call():
        for row_start in range(0, rows, tile_rows):
            part = hidden[row_start:row_start + tile_rows]
            for start in range(0, vocab, tile_columns):
                width = min(tile_columns, vocab - start)
                out = None if buffer is None else buffer[:part.shape[0], :-(-width // 4) * 4]
                lm_head_logits_with_summaries(part, weight[start:start + width], None, width, TEMPERATURE, out)
    return call


def main():
    n, h, v = 8192, 4096, 151936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    floor = time_ms(lambda: hidden @ weight.T)[0]
    rows = [("cuBLAS bf16, all rows", floor)]
    tiles = [(2208, v, "default row chunks, 2208 rows"), (1024, 12288, "lean tiles, 1024 x 12288")]
    tiles += [(n, columns, f"vocab slices of {columns} columns, all rows") for columns in (1536, 2048, 4096, 6144)]
    for tile_rows, tile_columns, what in tiles:
        rows.append((f"epilogue matmul, {what} ({tile_rows * tile_columns * 4 >> 20} MiB)",
                     time_ms(tiled_matmul(hidden, weight, tile_rows, tile_columns))[0]))
        rows.append(("  the same, no logits stored", time_ms(tiled_matmul(hidden, weight, tile_rows, tile_columns,
                                                                          store=False))[0]))
        print(rows[-2], rows[-1], flush=True)
    for columns in (1536, 4096):
        logits = torch.empty(n, columns, device="cuda")
        summaries = lm_head_logits_with_summaries(hidden, weight[:columns], None, columns, TEMPERATURE, logits)
        slices = -(-v // columns)
        for k in (8, 64):
            one = time_ms(lambda: topk_from_group_maxima(logits, summaries, k, TEMPERATURE, columns, "cuda"))[0]
            rows.append((f"top-k from group maxima of one {columns}-column slice, k={k} (× {slices} slices)",
                         one * slices))
    print_table(rows, floor, n, h, v, entropy)


if __name__ == "__main__":
    main()
