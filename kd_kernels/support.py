"""The loss once every row is reduced to its statistics: bins, divergences, CE, reduction.

Everything here is O(N·k) and differentiable with torch autograd: the reference feeds it
float64 statistics taken from materialized logits. The fused path computes the same loss and
its closed-form gradients in one Triton kernel (ops/support_loss.py) and shares the counted
rows, the metrics and the containers (`StudentRowStats`, `SupportGradients`) with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .options import ADAPTIVE_EPS, TAIL_FLOOR, DivergenceOptions


@dataclass
class StudentRowStats:
    """The student's row statistics that the loss depends on (and nothing else of the logits).

    values: ``[N, k]`` ``z[idx] / τ_s`` at the teacher ids (any value where the entry is invalid).
    lse_tempered: ``[N]`` ``logsumexp(z / τ_s)`` over the V* columns.
    label_logprob: ``[N]`` ``log_softmax(z)[label]`` at temperature 1 (any value on ignored rows),
        or None when there are no labels.
    top1: ``[N]`` int64 argmax of z over the V* columns (for metrics; no gradient).
    """

    values: torch.Tensor
    lse_tempered: torch.Tensor
    label_logprob: Optional[torch.Tensor]
    top1: torch.Tensor


def counted_rows(labels: Optional[torch.Tensor], num_rows: int, ignore_index: int, device) -> torch.Tensor:
    """``[N]`` bool: rows that contribute to the loss."""
    if labels is None:
        return torch.ones(num_rows, dtype=torch.bool, device=device)
    return labels != ignore_index


def tail_log_mass(log_mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log(max(1 - Σ_mask exp(log_mass), TAIL_FLOOR))`` per row, computed as -expm1(logsumexp);
    0 (and no gradient, not NaN) on rows without mass on the mask."""
    log_mass = log_mass.masked_fill(~mask, -math.inf)
    massless = torch.isneginf(log_mass).all(dim=-1)
    covered = torch.logsumexp(torch.where(massless.unsqueeze(-1), 0.0, log_mass), dim=-1)
    covered = torch.where(massless, -math.inf, covered)
    return torch.log(torch.clamp(-torch.expm1(covered), min=TAIL_FLOOR))


def masked_log_softmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log_softmax over the masked entries of each row; 0 elsewhere (and on rows with none). A row
    whose masked entries are all -inf gets the uniform distribution over them (equal logits),
    and they receive no gradient."""
    x = torch.where(mask, x, -math.inf)
    flat = torch.isneginf(x).all(dim=-1, keepdim=True)
    x = torch.where(flat, torch.where(mask | ~mask.any(dim=-1, keepdim=True), 0.0, -math.inf), x)
    return torch.where(mask, torch.log_softmax(x, dim=-1), 0.0)


def _log_weight(weight: float) -> float:
    return math.log(weight) if weight > 0 else -math.inf


def _logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.logaddexp, whose gradient is 0 (not NaN) where both are -inf."""
    both = torch.isneginf(a) & torch.isneginf(b)
    return torch.where(both, -math.inf, torch.logaddexp(torch.where(both, 0.0, a), torch.where(both, 0.0, b)))


def _weighted_log_ratio(weight: torch.Tensor, log_weight: torch.Tensor, log_other: torch.Tensor) -> torch.Tensor:
    """``weight · (log_weight − log_other)``, 0 where weight is 0 (0 · log 0 = 0), gradients without NaN."""
    some = weight > 0
    return torch.where(some, weight * (torch.where(some, log_weight, 0.0) - torch.where(some, log_other, 0.0)), 0.0)


def bin_divergence(log_p: torch.Tensor, log_q: torch.Tensor, mask: torch.Tensor, options: DivergenceOptions) -> torch.Tensor:
    """``[N]`` divergence between teacher p and student q over the masked bins of each row.

    log_p, log_q: ``[N, B]`` log-probabilities of the bins; mask: ``[N, B]`` bool.
    Bins outside the mask contribute exactly 0. A bin of probability 0 (log -inf) adds its limit
    (0 · log 0 = 0): forward_kl is +inf where q = 0 < p, the others stay finite.
    """
    log_p = torch.where(mask, log_p, 0.0)
    log_q = torch.where(mask, log_q, 0.0)
    p, q = torch.exp(log_p), torch.exp(log_q)

    def total(terms):
        return torch.where(mask, terms, 0.0).sum(dim=-1)

    def forward_kl():
        return total(_weighted_log_ratio(p, log_p, log_q))

    def reverse_kl():
        return total(_weighted_log_ratio(q, log_q, log_p))

    name = options.divergence
    if name == "forward_kl":
        return forward_kl()
    if name == "reverse_kl":
        return reverse_kl()
    if name == "jsd":
        beta = options.beta
        if beta == 0.0:
            return forward_kl()
        if beta == 1.0:
            return reverse_kl()
        log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
        return (beta * total(_weighted_log_ratio(p, log_p, log_m))
                + (1.0 - beta) * total(_weighted_log_ratio(q, log_q, log_m)))
    if name == "skewed_forward_kl":
        lam = options.skew_lambda
        if lam == 0.0:  # the mixture is q
            return forward_kl()
        log_mix = _logaddexp(_log_weight(lam) + log_p, _log_weight(1.0 - lam) + log_q)
        return total(_weighted_log_ratio(p, log_p, log_mix))
    if name == "skewed_reverse_kl":
        lam = options.skew_lambda
        if lam == 0.0:  # the mixture is p
            return reverse_kl()
        log_mix = _logaddexp(_log_weight(1.0 - lam) + log_p, _log_weight(lam) + log_q)
        return total(_weighted_log_ratio(q, log_q, log_mix))
    if name == "adaptive_kl":
        p_bins, q_bins = torch.where(mask, p, 0.0), torch.where(mask, q, 0.0)
        with torch.no_grad():
            order = torch.argsort(p_bins, dim=-1, stable=True)
            gap = torch.abs(p_bins - q_bins).gather(-1, order)
            in_tail = torch.cumsum(p_bins.gather(-1, order), dim=-1) <= options.adaptive_alpha
            gap_tail = torch.where(in_tail, gap, 0.0).sum(dim=-1)
            gap_head = torch.where(in_tail, 0.0, gap).sum(dim=-1)
        # a zero weight drops its term, even an infinite forward KL
        head = torch.where(gap_head > 0, gap_head * forward_kl(), 0.0)
        return (head + gap_tail * reverse_kl()) / (gap_head + gap_tail + ADAPTIVE_EPS)
    if name == "tvd":
        return 0.5 * total(torch.abs(p - q))
    raise ValueError(f"divergence: unknown {name!r}")


def row_bins(student: StudentRowStats, teacher_logprobs: torch.Tensor, valid: torch.Tensor, vocab_size: int, support: str):
    """Teacher and student log-probabilities of each row's bins and their mask.

    renormalized: the k valid entries, each side softmax-normalized over them.
    tail: the k entries normalized over the vocab plus one tail bin, absent when the valid
    entries already cover all ``vocab_size`` columns or the row has an invalid entry (the
    teacher ran out of finite columns: its tail mass is exactly 0).
    Returns (log_p, log_q, mask), each ``[N, k]`` or ``[N, k + 1]``.
    """
    teacher_logprobs = teacher_logprobs.to(student.values.dtype)
    if support == "renormalized":
        return masked_log_softmax(teacher_logprobs, valid), masked_log_softmax(student.values, valid), valid
    student_logprobs = student.values - student.lse_tempered.unsqueeze(-1)
    has_tail = valid.all(dim=-1, keepdim=True) & (valid.sum(dim=-1, keepdim=True) < vocab_size)
    log_p = torch.cat([teacher_logprobs, tail_log_mass(teacher_logprobs, valid).unsqueeze(-1)], dim=-1)
    log_q = torch.cat([student_logprobs, tail_log_mass(student_logprobs, valid).unsqueeze(-1)], dim=-1)
    return log_p, log_q, torch.cat([valid, has_tail], dim=-1)


def row_losses(student: StudentRowStats, teacher_logprobs: torch.Tensor, teacher_indices: torch.Tensor,
               counted: torch.Tensor, options: DivergenceOptions, vocab_size: int):
    """Per-row KD and CE, ``[N]`` each, zero on rows not counted; CE is None without labels."""
    valid = torch.isfinite(teacher_logprobs)
    log_p, log_q, mask = row_bins(student, teacher_logprobs, valid, vocab_size, options.support)
    kd = torch.where(counted, bin_divergence(log_p, log_q, mask, options), 0.0)
    ce = None
    if student.label_logprob is not None:
        ce = torch.where(counted, -student.label_logprob, 0.0)
    return kd, ce


def reduce_loss(kd: torch.Tensor, ce: Optional[torch.Tensor], counted: torch.Tensor,
                options: DivergenceOptions, num_tokens=None) -> torch.Tensor:
    """``kd_weight · KD + ce_weight · CE`` under ``options.reduction`` (see SPEC "Loss")."""
    per_row = kd * options.kd_weight if options.kd_weight != 0 else torch.zeros_like(kd)
    if options.ce_weight != 0:
        per_row = per_row + options.ce_weight * ce
    if options.reduction == "none":
        return per_row
    total = per_row.sum()
    if options.reduction == "sum":
        return total
    if num_tokens is None:
        divisor = counted.sum().clamp(min=1).to(total.dtype)
    elif isinstance(num_tokens, torch.Tensor):
        divisor = num_tokens.to(device=total.device, dtype=total.dtype)
    else:
        divisor = float(num_tokens)
    return total / divisor


def row_metrics(student: StudentRowStats, teacher_logprobs: torch.Tensor, teacher_indices: torch.Tensor,
                counted: torch.Tensor, kd: torch.Tensor, ce: Optional[torch.Tensor]) -> dict:
    """Sums over counted rows (so they add across ranks), detached, float32 / int64 tensors."""
    with torch.no_grad():
        valid = torch.isfinite(teacher_logprobs)
        teacher_mass = torch.where(valid, torch.exp(teacher_logprobs.to(student.values.dtype)), 0.0).sum(-1)
        student_logprobs = student.values - student.lse_tempered.unsqueeze(-1)
        student_mass = torch.where(valid, torch.exp(student_logprobs), 0.0).sum(-1)
        agree = valid[:, 0] & (student.top1 == teacher_indices[:, 0].long()) if teacher_logprobs.shape[1] else \
            torch.zeros_like(counted)

        def total(x):
            return torch.where(counted, x, 0).sum().float()

        return {
            "kd_sum": total(kd),
            "ce_sum": total(ce) if ce is not None else torch.zeros((), device=kd.device),
            "teacher_mass_sum": total(teacher_mass),
            "student_mass_sum": total(student_mass),
            "top1_agreement_sum": total(agree.float()),
            "rows": counted.sum(),
        }


@dataclass
class SupportGradients:
    """d objective / d statistic, float32: at the teacher ids ``[N, k]`` (w.r.t. raw logits
    z[idx]), at the label ``[N]``, and w.r.t. the two row logsumexps ``[N]`` (None when the
    objective does not depend on it, e.g. lse_tempered in renormalized mode without metrics)."""

    at_ids: torch.Tensor
    at_label: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]
    lse_tempered: Optional[torch.Tensor]
