"""`nn.Module` wrapper of `topk_divergence` for training loops that like modules."""
from __future__ import annotations

from typing import Optional

import torch

from .api import topk_divergence
from .options import DivergenceOptions
from .topk import TopK


class TopKDivergenceLoss(torch.nn.Module):
    """Holds the loss options; ``forward(hidden, weight, teacher, labels)`` returns the loss.

    Keyword arguments are those of `topk_divergence` (divergence, support, temperature,
    kd_weight, ce_weight, beta, skew_lambda, adaptive_alpha, ignore_index, reduction,
    vocab_size), checked here once; ``backend``, ``chunk_rows``, ``lean`` and ``check_values`` too.
    """

    def __init__(self, *, backend: str = "auto", chunk_rows: Optional[int] = None, lean: bool = False,
                 check_values: bool = True, **options):
        super().__init__()
        self.options = DivergenceOptions(**options)
        self.backend = backend
        self.chunk_rows = chunk_rows
        self.lean = lean
        self.check_values = check_values

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, teacher: TopK, labels: Optional[torch.Tensor] = None,
                *, bias: Optional[torch.Tensor] = None, num_tokens=None, return_metrics: bool = False):
        """hidden ``[N, H]``, weight ``[V, H]``, teacher `TopK` ``[N, k]``, labels ``[N]`` -> float32 loss."""
        return topk_divergence(hidden, weight, teacher, labels, bias=bias, num_tokens=num_tokens,
                               return_metrics=return_metrics, backend=self.backend, chunk_rows=self.chunk_rows, lean=self.lean,
                               check_values=self.check_values, **vars(self.options))

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={value!r}" for key, value in vars(self.options).items())
