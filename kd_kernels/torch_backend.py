"""``backend="torch"``: the public functions through the float64 reference (`reference`),
materializing ``[N, V]`` logits; under a vocab-parallel group (a `VocabShard`), the reference's
per-shard pieces combined over the group with the collectives of `distributed`. The only
module of the package that imports the oracle."""
from __future__ import annotations

from typing import Optional

import torch

from . import reference
from .distributed import (VocabShard, combine_argmax, combine_logsumexp, combine_topk, replicated_input,
                          sum_over_ranks)
from .options import DivergenceOptions
from .support import StudentRowStats
from .topk import TopK


def teacher_topk_from_logits(logits: torch.Tensor, k: int, temperature: float, vocab_size: int,
                             shard: Optional[VocabShard]) -> TopK:
    """The teacher's float64 top-k of logits ``[N, V]`` (this rank's shard under ``shard``)."""
    if shard is None:
        return reference.teacher_topk_from_logits(logits, k, temperature, vocab_size)
    values, ids, local_lse = reference.teacher_shard_candidates(logits, shard.rank, k, temperature, shard.vocab_size)
    return combine_topk(values, ids, local_lse, k, temperature, shard)


def teacher_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                 bias: Optional[torch.Tensor], shard: Optional[VocabShard]) -> TopK:
    """`teacher_topk_from_logits` of ``hidden @ weight.T + bias`` in float64."""
    return teacher_topk_from_logits(reference.lm_head_logits(hidden, weight, bias), k, temperature, vocab_size, shard)


def topk_divergence_from_logits(logits: torch.Tensor, teacher: TopK, labels: Optional[torch.Tensor],
                                options: DivergenceOptions, num_tokens, shard: Optional[VocabShard],
                                return_metrics: bool):
    """The float64 student loss from logits ``[N, V]`` (this rank's shard under ``shard``);
    gradients reach them."""
    if shard is None:
        return reference.topk_divergence_from_logits(logits, teacher, labels, options, num_tokens, return_metrics)
    pieces = reference.student_shard_pieces(logits, shard.rank, teacher, labels, options, shard.vocab_size)
    lse = combine_logsumexp(pieces.lse, shard)
    stats = StudentRowStats(
        values=sum_over_ranks(pieces.values, shard),
        lse_tempered=combine_logsumexp(pieces.lse_tempered, shard),
        label_logprob=None if labels is None else sum_over_ranks(pieces.label_values, shard) - lse,
        top1=combine_argmax(pieces.max, pieces.argmax, shard),
    )
    return reference.loss_from_row_stats(stats, teacher, labels, options, shard.vocab_size, num_tokens,
                                         return_metrics)


def topk_divergence(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], teacher: TopK,
                    labels: Optional[torch.Tensor], options: DivergenceOptions, num_tokens,
                    shard: Optional[VocabShard], return_metrics: bool):
    """`topk_divergence_from_logits` of ``hidden @ weight.T + bias`` in float64; gradients reach
    hidden, weight and bias (hidden, replicated over a group, receives them summed over it)."""
    if shard is not None:
        hidden = replicated_input(hidden, shard)
    return topk_divergence_from_logits(reference.lm_head_logits(hidden, weight, bias), teacher, labels, options,
                                       num_tokens, shard, return_metrics)


def teacher_sample(hidden: torch.Tensor, weight: torch.Tensor, num_samples: int, temperature: float,
                   vocab_size: int, bias: Optional[torch.Tensor], seed: int, row_offset: int):
    """The teacher's float64 Gumbel-top-n samples of ``hidden @ weight.T + bias``."""
    return reference.teacher_sample(hidden, weight, num_samples, temperature, vocab_size, bias, seed=seed,
                                    row_offset=row_offset)


def teacher_sample_from_logits(logits: torch.Tensor, num_samples: int, temperature: float, vocab_size: int,
                               seed: int, row_offset: int):
    """The teacher's float64 Gumbel-top-n samples of logits ``[N, V]``."""
    return reference.teacher_sample_from_logits(logits, num_samples, temperature, vocab_size, seed=seed,
                                                row_offset=row_offset)
