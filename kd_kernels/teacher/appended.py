"""The appended schedule (bf16 / fp16 inputs the epilogue matmul takes, k ≤ APPENDED_MAX_K): the
teacher's top-k without storing logits, within APPENDED_BYTES whatever N and V."""
from __future__ import annotations

from typing import Optional

import torch

from ..topk import TopK
from .chunks import empty_outputs, finish_with_redo, rows_in_quarter_groups

# a chunk's sample logits or keys (the same bytes), tile statistics, the sort's outputs
APPENDED_BYTES = 56 << 20
APPENDED_MAX_K = 1024  # the keys' slots (~1.5 · r · stride a row) stay within the extension sort's 4096


def appended_chunk_rows(num_rows: int, width: int, k: int, plan, element_size: int, block_n: int) -> int:
    """Rows per chunk of the appended schedule (`AppendedPlan` ``plan``): its buffers within
    APPENDED_BYTES, in quarters of the matmul's L2 group of row tiles. A row holds its sample
    logits, then in the same bytes its keys (``max(element_size · sample_columns, 8 ·
    capacity)``), its tile statistics (8 · V / block_n), its floor and count, and the sort's
    values and columns (8 · k)."""
    per_row = (max(element_size * plan.sample_columns, 8 * plan.capacity) + 8 * -(-width // block_n) + 8
               + 8 * k)
    return rows_in_quarter_groups(APPENDED_BYTES // per_row, num_rows)


def teacher_topk_appended(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                          bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                          select: str = "triton", stride: Optional[int] = None) -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` 16-bit (this rank's shard under ``shard``) -> `TopK`
    float32, 1 <= k <= APPENDED_MAX_K: per chunk of rows (`_appended_chunk`), the logits of
    every ``stride``-th column (None: `appended_plan`'s) give each row a floor, the epilogue
    matmul appends each element at or above it to the row's keys and keeps the tile statistics
    (the logsumexp), one ranking per row orders the keys (ops/topk_from_appended.py: the
    extension's sort for ``select="cuda"``, a Triton selection then a sort of k for "triton").
    Rows with fewer than k keys or more than the slots are redone by cuBLAS logits and the
    full-row selection ``select``."""
    from ..ops.lm_head_group_maxima import default_config
    from ..ops.topk_from_appended import appended_plan

    if not 1 <= k <= APPENDED_MAX_K:
        raise ValueError(f"k: the appended schedule takes 1 <= k <= {APPENDED_MAX_K}, got {k}")
    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    plan = appended_plan(width, k, stride)
    chunk_rows = chunk_rows or appended_chunk_rows(num_rows, width, k, plan, hidden.element_size(),
                                                   default_config().block_n)
    sample_bias = None if bias is None else bias[:width:plan.stride].contiguous()
    values, indices, lse, overflow = empty_outputs(num_rows, k, hidden.device, with_overflow=True)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        _appended_chunk(hidden[rows], weight, bias, sample_bias, width, k, temperature, plan, select,
                        (values[rows], indices[rows], lse[rows], overflow[rows]))
    # redone rows (rare) in chunks of half the budget
    return finish_with_redo(overflow, hidden, weight, k, temperature, width, bias,
                            max(1, APPENDED_BYTES // (8 * weight.shape[0])), select, (values, indices, lse), shard)


def _appended_chunk(part: torch.Tensor, weight: torch.Tensor, bias, sample_bias, width: int, k: int,
                    temperature: float, plan, select: str, outputs) -> None:
    """One chunk of `teacher_topk_appended`: rows ``part [R, H]`` -> ``outputs`` (its rows of the
    tempered values, local ids, lse and overflow) filled. Its buffers live only within this call,
    so the next chunk's never coexist with them."""
    from ..ops.lm_head_group_maxima import Appends, EpilogueMatmul
    from ..ops.topk_from_appended import chunk_buffers, rank_appended, sample_floors, tile_logsumexp

    sample, keys, floors, counts = chunk_buffers(part, plan)
    # both matmuls set up before the first launch: no host work between the launches
    sampler = EpilogueMatmul(part, weight[:width:plan.stride], sample_bias, plan.sample_width, temperature, sample)
    appender = EpilogueMatmul(part, weight, bias, width, temperature, None, appends=Appends(floors, keys, counts))
    sampler(0, plan.sample_width)
    sample_floors(sample[:, :plan.sample_width], plan.rank, floors)
    counts.zero_()
    summaries = appender(0, width)
    values, indices, lse, overflow = outputs
    tile_logsumexp(summaries.tile_max2, summaries.tile_sum2, lse)
    chunk_values, indices[:], overflow[:] = rank_appended(keys, counts, k, select)
    values.copy_(chunk_values.div_(temperature))
