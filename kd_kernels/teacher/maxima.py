"""The maxima schedule (bf16 / fp16 inputs the epilogue matmul takes, k ≤ MAXIMA_MAX_K): the
teacher's top-k without storing logits, within MAXIMA_BYTES whatever N and V."""
from __future__ import annotations

from typing import Optional

import torch

from ..topk import TopK
from .chunks import empty_outputs, finish_with_redo, rows_in_quarter_groups

# a chunk's summaries with group top-2, candidate keys and recomputed groups
MAXIMA_BYTES = 56 << 20
MAXIMA_MAX_K = 64


def maxima_chunk_rows(num_rows: int, width: int, k: int, group_columns: int, tile_columns: int) -> int:
    """Rows per chunk of the maxima schedule: its buffers within MAXIMA_BYTES, in quarters of the
    matmul's L2 group of row tiles. A row holds its tile statistics (8 · V / tile_columns
    bytes), each group's maximum, column and second largest (9 · V / group_columns) and 12
    bytes per candidate slot (``capacity_for(k)``: keys, group ids)."""
    from ..ops.topk_from_group_top2 import capacity_for

    per_row = 8 * width // tile_columns + 9 * width // group_columns + 12 * capacity_for(k)
    return rows_in_quarter_groups(MAXIMA_BYTES // per_row, num_rows)


def teacher_topk_maxima(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                        bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                        select: str = "triton") -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` 16-bit (this rank's shard under ``shard``) -> `TopK`
    float32, 1 <= k <= MAXIMA_MAX_K: per chunk of rows the Triton matmul leaves each row's
    tile statistics and each group's maximum, its column and the group's second largest
    (ops/lm_head_group_maxima.py, ``group_top2``); then (ops/topk_from_group_top2.py) groups
    whose maximum reaches a bound T below the row's k-th largest group maximum and whose second
    does not give one key each, the maximum itself; the few whose second reaches T too are
    computed again from hidden × weight and their elements ≥ T join the keys. Rows that
    overflow (massive ties) are redone by cuBLAS logits and the full-row selection ``select``."""
    from ..ops.lm_head_group_maxima import default_config, lm_head_logits_with_summaries
    from ..ops.topk_from_group_top2 import topk_from_group_top2

    if not 1 <= k <= MAXIMA_MAX_K:
        raise ValueError(f"k: the maxima schedule takes 1 <= k <= {MAXIMA_MAX_K}, got {k}")
    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    config = default_config()
    chunk_rows = chunk_rows or maxima_chunk_rows(num_rows, width, k, config.group_columns, config.block_n)
    values, indices, lse, overflow = empty_outputs(num_rows, k, hidden.device, with_overflow=True)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        summaries = lm_head_logits_with_summaries(hidden[rows], weight, bias, width, temperature, None,
                                                  group_top2=True)
        topk_from_group_top2(hidden[rows], weight, bias, summaries, k, temperature, width,
                             (values[rows], indices[rows], lse[rows], overflow[rows]))
        summaries = None  # freed before the next chunk's are made
    values.div_(temperature)
    return finish_with_redo(overflow, hidden, weight, k, temperature, width, bias,
                            max(1, MAXIMA_BYTES // (4 * weight.shape[0])), select, (values, indices, lse), shard)
