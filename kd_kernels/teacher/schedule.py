"""Which of the teacher's schedules a call takes, and the call."""
from __future__ import annotations

from typing import Optional

import torch

from ..topk import TopK
from .appended import APPENDED_MAX_K, teacher_topk_appended
from .logits_rows import teacher_topk_cublas
from .maxima import MAXIMA_MAX_K, teacher_topk_maxima
from .tiled import teacher_topk_tiled


def teacher_schedule(hidden: torch.Tensor, weight: torch.Tensor, k: int) -> str:
    """The schedule of `teacher_topk` on either GPU backend. Inputs the epilogue matmul takes
    (bf16 / fp16, rows at 16-byte boundaries) store no chunk of logits: "maxima" for k <=
    MAXIMA_MAX_K, "appended" for k <= APPENDED_MAX_K. Else "cublas" (cuBLAS float32 logits,
    then the full-row selection)."""
    from ..ops.lm_head_group_maxima import epilogue_applies

    applies = epilogue_applies(hidden, weight)
    if applies and k <= MAXIMA_MAX_K:
        return "maxima"
    return "appended" if applies and k <= APPENDED_MAX_K else "cublas"


def teacher_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                 bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                 select: str = "triton") -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` (this rank's shard under ``shard``) -> `TopK`
    float32 by the `teacher_schedule` schedule, ``chunk_rows`` rows a chunk (None: each
    schedule's own), ``select`` ("cuda" or "triton") the backend's full-row selection and
    ranking."""
    schedule = teacher_schedule(hidden, weight, k)
    if schedule == "maxima":
        return teacher_topk_maxima(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)
    if schedule == "appended":
        return teacher_topk_appended(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)
    return teacher_topk_cublas(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)


def teacher_topk_lean(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                      bias: Optional[torch.Tensor] = None, shard=None, select: str = "triton") -> TopK:
    """``lean=True``: within ~64 MiB beyond the inputs and outputs whatever N and V. The
    maxima and appended schedules already are (`teacher_schedule`); where neither applies, the
    tiled schedule instead of whole rows of cuBLAS logits."""
    schedule = teacher_schedule(hidden, weight, k)
    if schedule == "maxima":
        return teacher_topk_maxima(hidden, weight, k, temperature, vocab_size, bias, None, shard, select)
    if schedule == "appended":
        return teacher_topk_appended(hidden, weight, k, temperature, vocab_size, bias, None, shard, select)
    return teacher_topk_tiled(hidden, weight, k, temperature, vocab_size, bias, shard, select)
