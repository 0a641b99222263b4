"""The lm_head matmul into a float32 buffer, shared by the teacher and student chunked paths."""
from __future__ import annotations

import torch


def lm_head_logits_fp32(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``hidden [R, H] @ weight[V, H].T`` into the float32 ``out [R, V]``, accumulated in float32
    (bf16-rounded logits would move probabilities by several percent)."""
    if hidden.is_cuda and hidden.dtype != torch.float32:
        return torch.mm(hidden, weight.T, out_dtype=torch.float32, out=out)
    if hidden.dtype == torch.float32:
        return torch.mm(hidden, weight.T, out=out)
    return torch.mm(hidden.float(), weight.float().T, out=out)  # CPU interpreter tests only
