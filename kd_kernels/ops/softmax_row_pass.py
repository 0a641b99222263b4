"""Adapter of the CUDA kernel ``kd_kernels._C.softmax_row_pass`` (csrc/softmax_row_pass.cu): the
student's row statistics and dense gradient in one read of each float32 logits row, the row
held in the shared memory of a cluster of eight CTAs (the Triton `row_statistics` with a
gradient reads each row twice). The compiled module checks its inputs itself."""
from __future__ import annotations

from typing import Optional

import torch

from .row_statistics import RowStatistics
from .topk_candidates import load_extension


def softmax_row_pass(logits: torch.Tensor, bias: Optional[torch.Tensor], width: int, temperature: float,
                     out: RowStatistics, ids: Optional[torch.Tensor], labels: Optional[torch.Tensor],
                     grad: torch.Tensor, coef: torch.Tensor) -> RowStatistics:
    """What `row_statistics(logits, bias, width, temperature, out, ids, labels, grad=grad, coef=coef)`
    computes, on CUDA: logits ``[R, C]`` float32 (row stride a multiple of 4 elements, 16-byte
    aligned start), bias ``[C]`` any float dtype or None, ids ``[R, k]`` / labels ``[R]`` int64
    (safe: columns < width), grad ``[R, C]`` bf16 / fp16 / fp32 (may alias logits), coef ``[R]``
    float32. Writes ``out`` and ``grad``; returns ``out``."""
    bias = None if bias is None else bias.float().contiguous()
    load_extension().softmax_row_pass(logits, bias, width, 1.0 / temperature, ids, labels, coef, out.lse,
                                      out.lse_tempered, out.best, out.top1, out.at_ids, out.at_label, grad)
    return out
