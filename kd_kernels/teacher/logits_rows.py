"""The teacher's top-k from float32 logits rows: the logits a caller holds, or cuBLAS logits of a
chunk of rows at a time (float32 inputs, k > 1024, inputs the epilogue matmul does not take),
each through the full-row selection (`chunks.select_topk`)."""
from __future__ import annotations

from typing import Optional

import torch

from ..lm_head import lm_head_logits_fp32
from ..topk import TopK
from .chunks import empty_outputs, finish, select_topk

DEFAULT_CHUNK_BYTES = 5 << 28  # 1.25 GiB of float32 logits per chunk


def default_chunk_rows(num_rows: int, columns: int) -> int:
    """Rows per chunk of cuBLAS logits: DEFAULT_CHUNK_BYTES of float32 logits (all rows where
    they fit)."""
    return max(1, min(num_rows, DEFAULT_CHUNK_BYTES // (4 * columns)))


def teacher_topk_from_logits(logits: torch.Tensor, k: int, temperature: float, vocab_size: int, shard=None,
                             select: str = "triton") -> TopK:
    """logits ``[N, V]`` (bf16 / fp16 / fp32, rows read in place; this rank's shard under
    ``shard``) -> `TopK` float32."""
    width, column_start = (vocab_size, 0) if shard is None else (shard.existing, shard.vocab_start)
    candidates = select_topk(logits, None, k, temperature, width, column_start, select)
    return finish(*candidates, k, temperature, shard)


def teacher_topk_cublas(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                        bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                        select: str = "triton") -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` (this rank's shard under ``shard``) -> `TopK`
    float32, ``chunk_rows`` rows at a time (None: `default_chunk_rows`): cuBLAS float32 logits
    (``chunk_rows · V · 4`` bytes), then the full-row selection ``select``."""
    num_rows = hidden.shape[0]
    width, column_start = (vocab_size, 0) if shard is None else (shard.existing, shard.vocab_start)
    chunk_rows = chunk_rows or default_chunk_rows(num_rows, weight.shape[0])
    logits = torch.empty(min(chunk_rows, num_rows), weight.shape[0], dtype=torch.float32, device=hidden.device)
    values, indices, lse = empty_outputs(num_rows, k, hidden.device)
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        chunk = lm_head_logits_fp32(hidden[start:stop], weight, logits[:stop - start])
        values[start:stop], indices[start:stop], lse[start:stop] = select_topk(chunk, bias, k, temperature, width,
                                                                               column_start, select)
    return finish(values, indices, lse, k, temperature, shard)
