"""Vocab-parallel forms of the four public functions (``group=``), shared by the backends:
the torch reference path, and the teacher-candidate merge the Triton path uses too."""
from __future__ import annotations

from typing import Optional

import torch

from . import reference
from .distributed import (VocabShard, all_gather, combine_argmax, combine_logsumexp, replicated_input,
                          sum_over_ranks)
from .options import DivergenceOptions
from .support import StudentRowStats
from .topk import TopK


def merge_teacher_candidates(values: torch.Tensor, ids: torch.Tensor, local_lse: torch.Tensor, k: int,
                             temperature: float, shard: VocabShard) -> TopK:
    """Exact global top-k from each rank's top-k candidates: values ``[N, k]`` tempered logits
    (-inf where missing), ids ``[N, k]`` global, local_lse ``[N]``. Gathers N·k values, N·k
    int32 ids and N scalars from each rank: N·(8k + 4)·W bytes with float32 values."""
    all_values = all_gather(values, shard)  # [W, N, k], ranks in ascending order
    all_ids = all_gather(ids.to(torch.int32), shard).long()  # 4 + 4 bytes a candidate
    num_rows = values.shape[0]
    return reference.merge_teacher_candidates(
        all_values.permute(1, 0, 2).reshape(num_rows, -1), all_ids.permute(1, 0, 2).reshape(num_rows, -1),
        all_gather(local_lse, shard).T, k, temperature)


def teacher_topk_from_logits(logits: torch.Tensor, k: int, temperature: float, shard: VocabShard) -> TopK:
    """Reference (float64) teacher top-k of this rank's logits shard ``[N, V_local]``."""
    values, ids, local_lse = reference.teacher_shard_candidates(logits, shard.rank, k, temperature, shard.vocab_size)
    return merge_teacher_candidates(values, ids, local_lse, k, temperature, shard)


def topk_divergence_from_logits(logits: torch.Tensor, teacher: TopK, labels: Optional[torch.Tensor],
                                options: DivergenceOptions, num_tokens, shard: VocabShard, return_metrics: bool):
    """Reference (float64) student loss from this rank's logits shard; gradients reach it."""
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


def topk_divergence(hidden: torch.Tensor, weight: torch.Tensor, bias, teacher: TopK, labels, options, num_tokens,
                    shard: VocabShard, return_metrics: bool):
    """Reference student loss through this rank's lm_head shard; hidden (replicated) receives
    the gradient summed over the group."""
    logits = reference.lm_head_logits(replicated_input(hidden, shard), weight, bias)
    return topk_divergence_from_logits(logits, teacher, labels, options, num_tokens, shard, return_metrics)
