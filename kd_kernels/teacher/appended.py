"""The appended schedule (bf16 / fp16 inputs the epilogue matmul takes, k ≤ APPENDED_MAX_K): the
teacher's top-k without storing logits, within APPENDED_BYTES whatever N and V: first every
row's floor (teacher/floors.py), then per chunk of rows the appending matmul and the ranking."""
from __future__ import annotations

from typing import Optional

import torch

from ..topk import TopK
from .chunks import APPENDED_BYTES, appended_chunk_rows, empty_outputs, finish_with_redo
APPENDED_MAX_K = 1024  # the keys' slots (~1.5 · r · stride a row) stay within the extension sort's 4096


def teacher_topk_appended(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                          bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                          select: str = "triton", stride: Optional[int] = None) -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` 16-bit (this rank's shard under ``shard``) -> `TopK`
    float32, 1 <= k <= APPENDED_MAX_K: the logits of every ``stride``-th column (None:
    `appended_plan`'s) give each row a floor (`floors_of_rows`); per chunk of rows
    (`_appended_chunk`) the epilogue matmul appends each element at or above it to the row's
    keys and keeps the tile statistics (the logsumexp), one ranking per row orders the keys
    (ops/topk_from_appended.py: the extension's sort for ``select="cuda"``, a Triton selection
    then a sort of k for "triton").
    Rows with fewer than k keys or more than the slots are redone by cuBLAS logits and the
    full-row selection ``select``."""
    from ..ops.lm_head_group_maxima import default_config
    from ..ops.topk_from_appended import appended_plan, sample_floors
    from .floors import floors_of_rows

    if not 1 <= k <= APPENDED_MAX_K:
        raise ValueError(f"k: the appended schedule takes 1 <= k <= {APPENDED_MAX_K}, got {k}")
    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    plan = appended_plan(width, k, stride)
    sample_bias = None if bias is None else bias[:width:plan.stride].contiguous()
    floors = floors_of_rows(hidden, weight, sample_bias, width, plan, temperature, APPENDED_BYTES,
                            lambda sample, rows, part: sample_floors(sample, plan.rank, part))
    # a chunk's row also holds its count (4) and the sort's values and columns (8 · k)
    chunk_rows = chunk_rows or appended_chunk_rows(num_rows, width, plan, default_config().block_n, 4 + 8 * k)
    values, indices, lse, overflow = empty_outputs(num_rows, k, hidden.device, with_overflow=True)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        _appended_chunk(hidden[rows], weight, bias, width, k, temperature, plan, floors[rows], select,
                        (values[rows], indices[rows], lse[rows], overflow[rows]))
    # redone rows (rare) in chunks of half the budget
    return finish_with_redo(overflow, hidden, weight, k, temperature, width, bias,
                            max(1, APPENDED_BYTES // (8 * weight.shape[0])), select, (values, indices, lse), shard)


def _appended_chunk(part: torch.Tensor, weight: torch.Tensor, bias, width: int, k: int, temperature: float,
                    plan, floors: torch.Tensor, select: str, outputs) -> None:
    """One chunk of `teacher_topk_appended`: rows ``part [R, H]`` and their ``floors [R]`` ->
    ``outputs`` (its rows of the tempered values, local ids, lse and overflow) filled. Its buffers
    live only within this call, so the next chunk's never coexist with them."""
    from ..ops.buffers import empty_parts
    from ..ops.lm_head_group_maxima import Appends, EpilogueMatmul
    from ..ops.topk_from_appended import rank_appended, tile_logsumexp

    keys, counts = empty_parts(part.device, ((part.shape[0], plan.capacity), torch.int64),
                               ((part.shape[0],), torch.int32))
    appender = EpilogueMatmul(part, weight, bias, width, temperature, None, appends=Appends(floors, keys, counts))
    counts.zero_()
    summaries = appender(0, width)
    values, indices, lse, overflow = outputs
    tile_logsumexp(summaries.tile_max2, summaries.tile_sum2, lse)
    chunk_values, indices[:], overflow[:] = rank_appended(keys, counts, k, select)
    values.copy_(chunk_values.div_(temperature))
