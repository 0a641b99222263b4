"""Adapter of the CUDA kernel ``kd_kernels._C.topk_candidates`` (csrc/topk_candidates.cu).

Not a Triton kernel: it lives here because it is the same kind of thing, a pure function on
tensors. The compiled module checks its inputs itself; this adapter only loads it.
"""
from __future__ import annotations

import torch


def load_extension():
    """The compiled ``kd_kernels._C`` module (ImportError if it was not built)."""
    from .. import _C

    return _C


def topk_candidates(logits: torch.Tensor, k: int, temperature: float, width: int):
    """logits ``[R, ≥ width]`` bf16 / fp16 / fp32 on CUDA, columns contiguous ->
    (values ``[R, k]`` float32 = top logits / τ, descending, lower column first on ties,
    -inf past ``width``; columns ``[R, k]`` int32, 0 past ``width``; lse ``[R]`` float32 of
    ``logits[:, :width] / τ``). Two reads of each row; nothing of size V is allocated."""
    return load_extension().topk_candidates(logits, k, float(temperature), width)
