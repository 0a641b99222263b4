"""Plain PyTorch of the whole SPEC math, in float64: the oracle of every test, and the CPU path.

Materializes ``[N, V]`` logits on purpose. Two forms:
- unsharded: `teacher_topk`, `teacher_topk_from_logits`, `topk_divergence`,
  `topk_divergence_from_logits`;
- vocab-sharded, as a pure function over a list of logit shards (shard r holds global
  columns ``[r·V_local, (r+1)·V_local)``): `teacher_topk_sharded`,
  `topk_divergence_sharded` — the oracle of the tensor-parallel kernels. They combine
  per-shard statistics the way the distributed kernels do and must equal the unsharded form.

No input validation here beyond what the math needs: the public API validates.
Unlike the public API, ``k`` may exceed the number of columns (missing entries are
``-inf`` / index 0), which a vocab shard smaller than k needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from .options import DivergenceOptions
from .support import StudentRowStats, counted_rows, reduce_loss, row_losses, row_metrics
from .topk import TopK


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[N, V]`` float64 ``hidden @ weight.T (+ bias)``."""
    logits = hidden.double() @ weight.double().T
    return logits if bias is None else logits + bias.double()


def _existing_columns(logits: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
    return logits if vocab_size is None else logits[:, :vocab_size]


def _sorted_topk(scores: torch.Tensor, k: int, column_offset: int = 0):
    """Top-k of each row, descending, lower column first on ties; padded to k with (-inf, 0)."""
    n, columns = scores.shape
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    kept = min(k, columns)
    values, indices = values[:, :kept], order[:, :kept] + column_offset
    if kept < k:
        values = torch.cat([values, scores.new_full((n, k - kept), -math.inf)], dim=-1)
        indices = torch.cat([indices, indices.new_zeros((n, k - kept))], dim=-1)
    indices = torch.where(torch.isfinite(values), indices, 0)
    return values, indices


def teacher_topk_from_logits(logits: torch.Tensor, k: int, temperature: float = 1.0,
                             vocab_size: Optional[int] = None) -> TopK:
    """``topk(log_softmax(logits[:, :V*] / τ), k)``, float64 log-probs, int32 ids, float64 lse.
    A row of only -inf logits has lse -inf and only missing entries (-inf, id 0), not NaN."""
    tempered = _existing_columns(logits, vocab_size).double() / temperature
    lse = torch.logsumexp(tempered, dim=-1)
    logprobs, indices = _sorted_topk(tempered - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1), k)
    return TopK(logprobs, indices.to(torch.int32), lse, temperature)


def teacher_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float = 1.0,
                 vocab_size: Optional[int] = None, bias: Optional[torch.Tensor] = None) -> TopK:
    """`teacher_topk_from_logits` of ``hidden @ weight.T (+ bias)``."""
    return teacher_topk_from_logits(lm_head_logits(hidden, weight, bias), k, temperature, vocab_size)


def _safe_ids(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, ids.long(), 0)


def student_row_stats(logits: torch.Tensor, teacher: TopK, labels: Optional[torch.Tensor],
                      options: DivergenceOptions) -> StudentRowStats:
    """The student's statistics from materialized logits: log_softmax over V*, then gathers."""
    z = _existing_columns(logits, options.vocab_size).double()
    ids = _safe_ids(teacher.indices, teacher.valid)
    tempered = z / options.temperature
    label_logprob = None
    if labels is not None:
        label_ids = _safe_ids(labels, labels != options.ignore_index).unsqueeze(-1)
        label_logprob = torch.log_softmax(z, dim=-1).gather(-1, label_ids).squeeze(-1)
    return StudentRowStats(
        values=tempered.gather(-1, ids),
        lse_tempered=torch.logsumexp(tempered, dim=-1),
        label_logprob=label_logprob,
        top1=z.argmax(dim=-1),
    )


def loss_from_row_stats(student: StudentRowStats, teacher: TopK, labels: Optional[torch.Tensor],
                        options: DivergenceOptions, vocab_size: int, num_tokens=None,
                        return_metrics: bool = False):
    counted = counted_rows(labels, teacher.logprobs.shape[0], options.ignore_index, student.values.device)
    if options.support == "sampled":
        kd, ce = sampled_row_losses(student, teacher, counted, options)
    else:
        kd, ce = row_losses(student, teacher.logprobs, teacher.indices, counted, options, vocab_size)
    loss = reduce_loss(kd, ce, counted, options, num_tokens)
    if return_metrics:
        return loss, row_metrics(student, teacher.logprobs, teacher.indices, counted, kd, ce)
    return loss


def topk_divergence_from_logits(logits: torch.Tensor, teacher: TopK, labels: Optional[torch.Tensor] = None,
                                options: DivergenceOptions = DivergenceOptions(), num_tokens=None,
                                return_metrics: bool = False):
    """The student loss of the SPEC from ``[N, V]`` logits, float64, differentiable."""
    vocab_size = options.vocab_size or logits.shape[-1]
    stats = student_row_stats(logits, teacher, labels, options)
    return loss_from_row_stats(stats, teacher, labels, options, vocab_size, num_tokens, return_metrics)


def topk_divergence(hidden: torch.Tensor, weight: torch.Tensor, teacher: TopK, labels: Optional[torch.Tensor] = None,
                    options: DivergenceOptions = DivergenceOptions(), num_tokens=None,
                    bias: Optional[torch.Tensor] = None, return_metrics: bool = False):
    """`topk_divergence_from_logits` of ``hidden @ weight.T (+ bias)``; grads reach hidden, weight, bias."""
    return topk_divergence_from_logits(lm_head_logits(hidden, weight, bias), teacher, labels, options,
                                       num_tokens, return_metrics)


# ---------------------------------------------------------------------------------------
# Vocab-sharded oracle: per-shard statistics, combined with O(N·k) and O(N) values only.
# ---------------------------------------------------------------------------------------

def _shard_columns(shard: torch.Tensor, rank: int, vocab_size: int) -> torch.Tensor:
    """The columns of shard ``rank`` that exist (global id < vocab_size), float64."""
    local_vocab = shard.shape[-1]
    existing = max(0, min(local_vocab, vocab_size - rank * local_vocab))
    return shard[:, :existing].double()


def _global_vocab(shards: Sequence[torch.Tensor], vocab_size: Optional[int]) -> int:
    return vocab_size if vocab_size is not None else sum(s.shape[-1] for s in shards)


def teacher_shard_candidates(shard: torch.Tensor, rank: int, k: int, temperature: float, vocab_size: int):
    """One shard's part of the teacher top-k: its top-k tempered logits ``[N, k]`` (lower id
    first on ties, -inf / id 0 where it has fewer columns), their global ids, and the
    logsumexp ``[N]`` of its tempered logits (-inf if it holds no existing column)."""
    tempered = _shard_columns(shard, rank, vocab_size) / temperature
    values, ids = _sorted_topk(tempered, k, column_offset=rank * shard.shape[-1])
    return values, ids, torch.logsumexp(tempered, dim=-1)


def merge_teacher_candidates(values: torch.Tensor, ids: torch.Tensor, local_lses: torch.Tensor, k: int,
                             temperature: float, vocab_size: int) -> TopK:
    """Exact global top-k from ``[N, W·k]`` candidates (global ids; -inf at id 0 where a shard has
    fewer columns) and ``[N, W]`` shard logsumexps: the candidates put back in a row of V* columns
    (-inf elsewhere), then that row's top-k."""
    lse = torch.logsumexp(local_lses, dim=-1)
    row = values.new_full((values.shape[0], vocab_size), -math.inf)
    row.scatter_reduce_(-1, ids.long(), values, reduce="amax")  # a missing entry's -inf leaves column 0 as it is
    logprobs, indices = _sorted_topk(row - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1), k)  # -inf rows stay -inf
    return TopK(logprobs, indices.to(torch.int32), lse, temperature)


def teacher_topk_sharded(logit_shards: Sequence[torch.Tensor], k: int, temperature: float = 1.0,
                         vocab_size: Optional[int] = None) -> TopK:
    """Teacher top-k from vocab shards: local top-k and local logsumexp per shard, then an
    exact merge of the ``world · k`` candidates (lower global id first on ties)."""
    vocab_size = _global_vocab(logit_shards, vocab_size)
    parts = [teacher_shard_candidates(shard, rank, k, temperature, vocab_size) for rank, shard in enumerate(logit_shards)]
    values, ids, lses = zip(*parts)
    return merge_teacher_candidates(torch.cat(values, -1), torch.cat(ids, -1), torch.stack(lses, -1), k, temperature,
                                    vocab_size)


def _owned_gather(columns: torch.Tensor, global_ids: torch.Tensor, column_offset: int):
    """Values at the global ids this shard owns (0 elsewhere)."""
    local_ids = global_ids - column_offset
    owned = (local_ids >= 0) & (local_ids < columns.shape[-1])
    if columns.shape[-1] == 0:
        return torch.zeros(global_ids.shape, dtype=columns.dtype, device=columns.device)
    values = columns.gather(-1, torch.where(owned, local_ids, 0))
    return torch.where(owned, values, 0.0)


@dataclass
class StudentShardPieces:
    """One shard's part of the student statistics, before combining over shards (``[N]`` unless
    noted): tempered logits at the teacher ids it owns ``[N, k]`` (0 elsewhere), the logit at
    the label if it owns it (0 elsewhere), its two logsumexps, and its row max and argmax."""

    values: torch.Tensor
    label_values: Optional[torch.Tensor]
    lse: torch.Tensor
    lse_tempered: torch.Tensor
    max: torch.Tensor
    argmax: torch.Tensor


def student_shard_pieces(shard: torch.Tensor, rank: int, teacher: TopK, labels: Optional[torch.Tensor],
                         options: DivergenceOptions, vocab_size: int) -> StudentShardPieces:
    z = _shard_columns(shard, rank, vocab_size)
    offset = rank * shard.shape[-1]
    tempered = z / options.temperature
    label_values = None
    if labels is not None:
        label_ids = _safe_ids(labels, labels != options.ignore_index).unsqueeze(-1)
        label_values = _owned_gather(z, label_ids, offset).squeeze(-1)
    if z.shape[-1]:
        row_max, row_argmax = z.max(dim=-1)
    else:
        row_max = z.new_full((z.shape[0],), -math.inf)
        row_argmax = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    return StudentShardPieces(
        values=_owned_gather(tempered, _safe_ids(teacher.indices, teacher.valid), offset),
        label_values=label_values,
        lse=torch.logsumexp(z, dim=-1),
        lse_tempered=torch.logsumexp(tempered, dim=-1),
        max=row_max,
        argmax=row_argmax + offset,
    )


def student_row_stats_sharded(logit_shards: Sequence[torch.Tensor], teacher: TopK, labels: Optional[torch.Tensor],
                              options: DivergenceOptions, vocab_size: int) -> StudentRowStats:
    """Student statistics from vocab shards: per-shard pieces, summed / merged across shards."""
    pieces = [student_shard_pieces(shard, rank, teacher, labels, options, vocab_size)
              for rank, shard in enumerate(logit_shards)]
    # the first shard holding the maximum wins, as argmax over the whole row would
    best_shard = torch.stack([p.max for p in pieces], dim=-1).argmax(dim=-1, keepdim=True)
    top1 = torch.stack([p.argmax for p in pieces], dim=-1).gather(-1, best_shard).squeeze(-1)
    lse = torch.logsumexp(torch.stack([p.lse for p in pieces], dim=-1), dim=-1)
    return StudentRowStats(
        values=sum(p.values for p in pieces),
        lse_tempered=torch.logsumexp(torch.stack([p.lse_tempered for p in pieces], dim=-1), dim=-1),
        label_logprob=None if labels is None else sum(p.label_values for p in pieces) - lse,
        top1=top1,
    )


def topk_divergence_sharded(logit_shards: Sequence[torch.Tensor], teacher: TopK, labels: Optional[torch.Tensor] = None,
                            options: DivergenceOptions = DivergenceOptions(), num_tokens=None,
                            return_metrics: bool = False):
    """The student loss from vocab shards of the logits; ``options.vocab_size`` is global."""
    vocab_size = _global_vocab(logit_shards, options.vocab_size)
    stats = student_row_stats_sharded(logit_shards, teacher, labels, options, vocab_size)
    return loss_from_row_stats(stats, teacher, labels, options, vocab_size, num_tokens, return_metrics)


# ---------------------------------------------------------------------------------------
# Sampled sparse KD (docs/DESIGN.md, "Sampled sparse KD"): Gumbel-top-n samples of the teacher
# and the unbiased estimate of the full-vocab divergence from them.
# ---------------------------------------------------------------------------------------

def teacher_sample_from_logits(logits: torch.Tensor, num_samples: int, temperature: float = 1.0,
                               vocab_size: Optional[int] = None, *, seed: int, row_offset: int = 0):
    """`TeacherSamples` (float64 log-probs) of ``logits [N, V]``: keys ``log_softmax(logits[:, :V*]
    / τ) + G`` with G = `sampling.gumbel_noise` of (seed, row_offset + row, column); the n largest
    (lower column first on ties) are the samples, the (n+1)-th the threshold."""
    from .samples import TeacherSamples
    from .sampling import gumbel_noise

    tempered = _existing_columns(logits, vocab_size).double() / temperature
    lse = torch.logsumexp(tempered, dim=-1)
    rows = row_offset + torch.arange(tempered.shape[0], device=tempered.device)
    noise = gumbel_noise(seed, rows, torch.arange(tempered.shape[1], device=tempered.device))
    keys, ids = _sorted_topk(tempered - lse.unsqueeze(-1) + noise, num_samples + 1)
    logprobs = torch.where(torch.isfinite(keys), (tempered - lse.unsqueeze(-1)).gather(-1, ids), -math.inf)
    return TeacherSamples(logprobs[:, :num_samples], ids[:, :num_samples].to(torch.int32), keys[:, num_samples],
                          lse, temperature, seed)


def teacher_sample(hidden: torch.Tensor, weight: torch.Tensor, num_samples: int, temperature: float = 1.0,
                   vocab_size: Optional[int] = None, bias: Optional[torch.Tensor] = None, *, seed: int,
                   row_offset: int = 0):
    """`teacher_sample_from_logits` of ``hidden @ weight.T (+ bias)``."""
    return teacher_sample_from_logits(lm_head_logits(hidden, weight, bias), num_samples, temperature, vocab_size,
                                      seed=seed, row_offset=row_offset)


def sampled_row_losses(student: StudentRowStats, samples, counted: torch.Tensor, options: DivergenceOptions):
    """Per-row KD and CE ``[N]`` (0 on rows not counted; CE None without labels), KD the unbiased
    estimate `sampling.sampled_row_divergence` of ``options.divergence`` between the teacher and
    the student's full-vocab ``softmax(z / τ)``, from `TeacherSamples` ``samples``."""
    from .sampling import log_inclusion, sampled_row_divergence

    log_p = samples.logprobs.to(student.values.dtype)
    kd = sampled_row_divergence(log_p, student.values, student.lse_tempered,
                                log_inclusion(log_p, samples.log_threshold.to(log_p.dtype)), options.divergence,
                                options.beta, options.skew_lambda)
    ce = None if student.label_logprob is None else torch.where(counted, -student.label_logprob, 0.0)
    return torch.where(counted, kd, 0.0), ce


def sampled_divergence_from_logits(logits: torch.Tensor, samples, labels: Optional[torch.Tensor] = None,
                                   options: DivergenceOptions = DivergenceOptions(), num_tokens=None):
    """``kd_weight · KD + ce_weight · CE`` reduced by ``options.reduction``, float64,
    differentiable, KD per row `sampled_row_losses`' estimate from `TeacherSamples` ``samples``:
    `topk_divergence_from_logits` with support "sampled"."""
    return topk_divergence_from_logits(logits, samples, labels, replace(options, support="sampled"),
                                       num_tokens)


def sampled_divergence(hidden: torch.Tensor, weight: torch.Tensor, samples, labels: Optional[torch.Tensor] = None,
                       options: DivergenceOptions = DivergenceOptions(), num_tokens=None,
                       bias: Optional[torch.Tensor] = None):
    """`sampled_divergence_from_logits` of ``hidden @ weight.T (+ bias)``."""
    return sampled_divergence_from_logits(lm_head_logits(hidden, weight, bias), samples, labels, options, num_tokens)
