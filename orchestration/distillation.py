"""Any Hugging Face causal LM as a distillation student or teacher: the student's forward is the
fused top-k loss over its final hidden states and output embedding, the teacher's scoring the
top-k of its own; neither ever holds ``[N, V]`` logits on the GPU backends.

The loss lives inside `DistillationStudent.forward` so that FSDP2 (`orchestration.fsdp`)
gathers the output embedding around it like any other parameter of its root unit.
"""
from __future__ import annotations

from typing import Optional

import torch

import kd_kernels as kd

from .hf_models import final_hidden_states, output_embedding

_LOSS_OPTIONS = ("divergence", "temperature", "support", "kd_weight", "ce_weight", "beta", "skew_lambda",
                 "adaptive_alpha", "backend", "chunk_rows", "lean")


class DistillationStudent(torch.nn.Module):
    """A causal LM whose forward returns ``kd.topk_divergence`` of its next-token predictions.

    Args:
        causal_lm: a Hugging Face causal LM (``get_decoder()`` and ``get_output_embeddings()``).
        vocab_size: V*, the real vocabulary (lm_head rows at or past it are padding).
        compute_dtype: the dtype of the loss's matmuls, hidden states and lm_head cast to it
            (differentiably); None keeps the hidden states' dtype (under FSDP2's bf16 mixed
            precision they are bf16 already; on CPU float32).
        **loss_options: keyword arguments of ``kd.topk_divergence`` (divergence, temperature,
            support, kd_weight, ce_weight, beta, skew_lambda, adaptive_alpha, backend,
            chunk_rows, lean).
    """

    def __init__(self, causal_lm, *, vocab_size: int, compute_dtype: Optional[torch.dtype] = None, **loss_options):
        super().__init__()
        unknown = sorted(set(loss_options) - set(_LOSS_OPTIONS))
        if unknown:
            raise TypeError(f"loss_options: unknown {unknown}; expected some of {list(_LOSS_OPTIONS)}")
        self.causal_lm = causal_lm
        self.vocab_size, self.compute_dtype, self.loss_options = vocab_size, compute_dtype, loss_options

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, teacher: kd.TopK, *, num_tokens=None,
                position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                reduction: str = "mean", check_values: bool = True, rows: Optional[torch.Tensor] = None,
                ce_weight: Optional[float] = None):
        """(loss, metrics) of ``kd.topk_divergence(hidden, W, teacher, labels, bias=b, ...)``.

        Args:
            input_ids, labels: ``[B, T]`` int64; labels shifted (``labels[b, t]`` is the token
                after ``t``), -100 where nothing is predicted.
            teacher: `kd.TopK` of ``B · T`` rows, in (batch, position) order.
            num_tokens: the "mean" reduction's denominator (the step's token count over every
                rank and micro-batch, so that gradient sums over ranks equal one process's).
            position_ids, attention_mask: as in `hf_models.final_hidden_states`.
            rows: ``[R]`` flat indices into ``B · T``: only those rows are trained (``labels``
                and ``teacher`` then hold ``R`` rows).
            ce_weight: this call's CE weight (None: the loss options').
        Returns:
            float32 loss and the metrics dict of sums (``kd_sum``, ``ce_sum``, ``rows``, ...).
        """
        hidden = final_hidden_states(self.causal_lm, input_ids, position_ids=position_ids,
                                     attention_mask=attention_mask)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if rows is not None:
            hidden = hidden[rows]
        options = self.loss_options if ce_weight is None else dict(self.loss_options, ce_weight=ce_weight)
        weight, bias = output_embedding(self.causal_lm)
        dtype = self.compute_dtype or hidden.dtype
        bias = None if bias is None else bias.to(dtype)
        return kd.topk_divergence(hidden.to(dtype), weight.to(dtype), teacher, labels.reshape(-1), bias=bias,
                                  num_tokens=num_tokens, vocab_size=self.vocab_size, reduction=reduction,
                                  return_metrics=True, check_values=check_values, **options)


@torch.no_grad()
def score_teacher(causal_lm, input_ids: torch.Tensor, *, k: int, vocab_size: int, temperature: float = 1.0,
                  position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                  compute_dtype: Optional[torch.dtype] = None, backend: str = "auto") -> kd.TopK:
    """``kd.teacher_topk`` of a causal LM's final hidden states: ``B · T`` rows in (batch,
    position) order. ``compute_dtype`` casts the hidden states and lm_head (None: the hidden
    states' dtype)."""
    hidden = final_hidden_states(causal_lm, input_ids, position_ids=position_ids, attention_mask=attention_mask)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    weight, bias = output_embedding(causal_lm)
    dtype = compute_dtype or hidden.dtype
    return kd.teacher_topk(hidden.to(dtype), weight.to(dtype), k, temperature=temperature, vocab_size=vocab_size,
                           bias=None if bias is None else bias.to(dtype), backend=backend)
