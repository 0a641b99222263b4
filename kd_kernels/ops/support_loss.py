"""KD divergence over each row's top-k bins and its closed-form gradient, one program per row.

Inputs are the row statistics (teacher log-probs, the student's raw logits at the teacher
ids, ``logsumexp(z / τ)``); outputs the per-row divergence and, when asked, its gradient
w.r.t. the raw logits at the ids and w.r.t. ``logsumexp(z / τ)``. With ``u_i = ∂D/∂log q_i``:

- renormalized: ``∂D/∂s_i = u_i − q_i Σ_j u_j`` (softmax over the valid ids);
- tail: ``log q_i = s_i − lse_τ``, tail bin ``q_T = max(1 − Σ q_i, floor)``;
  ``w_i = u_i − u_T q_i / (1 − Σ q)`` (the second term only when the floor is not active),
  ``∂D/∂s_i = w_i``, ``∂D/∂lse_τ = −Σ w_i``;
- sampled (the ids are Gumbel-top-n samples, `kd_kernels.sampling`): ``log q_i = s_i − lse_τ``,
  ``1/π_i = 1 / (1 − exp(−exp(log p_i − threshold)))`` (1 where the row's threshold is −inf),
  the sampled term ``t' = t − c (q − p)`` and ``u' = u − c q`` (c = `control_variate_slope`:
  reverse KLs only), ``D = Σ t'_i / π_i``, ``w_i = u'_i / π_i``, ``∂D/∂s_i = w_i`` and
  ``∂D/∂lse_τ = −Σ w_i``, except forward_kl: 1 (its dense part at its mean).
Per bin (p teacher, q student): forward_kl ``u = −p``; reverse_kl ``u = q (log q − log p + 1)``;
jsd ``u = (1−β) q (log q − log m)``; skewed_forward_kl ``u = −(1−λ) p q / mix``;
skewed_reverse_kl ``u = q (log q − log mix + 1 − λ q / mix)``; tvd ``u = −½ q sign(p − q)``.
adaptive_kl ``(g_h · forward_kl + g_t · reverse_kl) / (g_h + g_t + ε)`` with the detached gaps
``g = Σ |p − q|`` over the head and tail bins; a bin is in the tail when the mass of the bins
at or before it in ascending (p, position) order is ≤ α. That order is the reference's stable
sort. Rows whose p never increases with position (a teacher's top-k, sorted descending) get
each bin's cumulative mass from one reverse scan (O(k)); other rows by comparisons with every
other bin, in blocks of bins (O(k²), no sort), so the bins need no particular order.
"""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..options import ADAPTIVE_EPS, TAIL_FLOOR
from ..sampling import control_variate_slope
from .utils import logaddexp

FORWARD_KL, REVERSE_KL, JSD, SKEWED_FORWARD_KL, SKEWED_REVERSE_KL, TVD, ADAPTIVE_KL = range(7)
_SELECTOR = {"forward_kl": FORWARD_KL, "reverse_kl": REVERSE_KL, "jsd": JSD, "skewed_forward_kl": SKEWED_FORWARD_KL,
             "skewed_reverse_kl": SKEWED_REVERSE_KL, "tvd": TVD, "adaptive_kl": ADAPTIVE_KL}
_COMPARE_BLOCK = 16  # bins compared with a whole row at a time (adaptive_kl)


@triton.jit
def _neg_expm1(x):
    """1 − exp(x) for x <= 0, accurate near 0 (Kahan's expm1: (u − 1) · x / log u)."""
    u = tl.exp(x)
    regular = (u != 1.0) & (u != 0.0)
    safe_log_u = tl.where(regular, tl.log(tl.where(regular, u, 2.0)), 1.0)
    expm1 = tl.where(u == 1.0, x, tl.where(u == 0.0, -1.0, (u - 1.0) * tl.where(regular, x, 0.0) / safe_log_u))
    return -expm1


@triton.jit
def _bin_terms(lp, lq, DIVERGENCE: tl.constexpr, log_beta, log_one_minus_beta, beta, lam, log_lam,
               log_one_minus_lam):
    """(divergence term, u = ∂term/∂log q) of each bin. A bin of probability 0 adds the limit
    (0 · log 0 = 0): where q = 0 every q-weighted term and u are 0 (forward_kl's term is +inf)."""
    p = tl.exp(lp)
    q = tl.exp(lq)
    some_q = q > 0.0
    if DIVERGENCE == 0:
        term = tl.where(p > 0.0, p * (lp - lq), 0.0)
        u = -p
    elif DIVERGENCE == 1:
        term = tl.where(some_q, q * (lq - lp), 0.0)
        u = tl.where(some_q, q * (lq - lp + 1.0), 0.0)
    elif DIVERGENCE == 2:
        lm = logaddexp(log_beta + lp, log_one_minus_beta + lq)
        term = beta * p * (lp - lm) + tl.where(some_q, (1.0 - beta) * q * (lq - lm), 0.0)
        u = tl.where(some_q, (1.0 - beta) * q * (lq - lm), 0.0)
    elif DIVERGENCE == 3:
        lmix = logaddexp(log_lam + lp, log_one_minus_lam + lq)
        term = p * (lp - lmix)
        u = -(1.0 - lam) * p * tl.exp(lq - lmix)
    elif DIVERGENCE == 4:
        lmix = logaddexp(log_one_minus_lam + lp, log_lam + lq)
        term = tl.where(some_q, q * (lq - lmix), 0.0)
        u = tl.where(some_q, q * (lq - lmix + 1.0 - lam * tl.exp(lq - lmix)), 0.0)
    else:
        term = 0.5 * tl.abs(p - q)
        sign = tl.where(p > q, 1.0, tl.where(p < q, -1.0, 0.0))
        u = -0.5 * q * sign
    return term, u


@triton.jit
def _bin_p(teacher_row_ptr, positions, k, shift):
    """p of the bins at ``positions`` (0 outside [0, k) and where invalid), computed exactly as
    the row's own, so that equal log-probs give bit-equal p."""
    inside = (positions >= 0) & (positions < k)
    t = tl.load(teacher_row_ptr + positions, mask=inside, other=float("-inf")).to(tl.float32)
    valid = t > float("-inf")
    return tl.where(valid, tl.exp(tl.where(valid, t - shift, 0.0)), 0.0)


@triton.jit
def _mass_at_or_before(p, p_after, teacher_row_ptr, k, shift, BLOCK_K: tl.constexpr, COMPARE_BLOCK: tl.constexpr):
    """``[BLOCK_K]`` mass of the bins at or before each bin in ascending (p, position) order;
    ``p_after``: one more bin placed after every other (the tail bin), counted where smaller.
    Each block of other bins is reloaded and its p recomputed exactly as the row's own."""
    positions = tl.arange(0, BLOCK_K)
    mass = tl.where(p_after < p, p_after, 0.0)
    for start in tl.static_range(0, BLOCK_K, COMPARE_BLOCK):
        others = start + tl.arange(0, COMPARE_BLOCK)
        p_other = _bin_p(teacher_row_ptr, others, k, shift)
        before = (p_other[None, :] < p[:, None]) | ((p_other[None, :] == p[:, None])
                                                    & (others[None, :] <= positions[:, None]))
        mass += tl.sum(tl.where(before, p_other[None, :], 0.0), axis=1)
    return mass


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _is_descending(p, teacher_row_ptr, k, shift, BLOCK_K: tl.constexpr):
    """Whether the row's p never increases with position (teachers' top-k come sorted)."""
    positions = tl.arange(0, BLOCK_K)
    p_next = _bin_p(teacher_row_ptr, positions + 1, k, shift)
    return tl.sum(((p_next > p) & (positions + 1 < k)).to(tl.int32), axis=0) == 0


@triton.jit
def _mass_at_or_before_descending(p, p_after, BLOCK_K: tl.constexpr):
    """`_mass_at_or_before` for rows whose p never increases with position, in O(k): the bins
    after a bin's run of equal p come before it in ascending (p, position) order, and so do
    the bins of its run up to its own position. Equal-p runs are contiguous here."""
    positions = tl.arange(0, BLOCK_K)
    after = tl.cumsum(p, axis=0, reverse=True) - p  # Σ_{j > i} p_j, no cancellation
    p_prev = tl.reshape(tl.gather(p, tl.maximum(positions - 1, 0), 0), [BLOCK_K])
    p_next = tl.reshape(tl.gather(p, tl.minimum(positions + 1, BLOCK_K - 1), 0), [BLOCK_K])
    run_start = tl.associative_scan(tl.where((positions == 0) | (p != p_prev), positions, 0), 0, _max_combine)
    run_end = tl.associative_scan(tl.where((positions == BLOCK_K - 1) | (p != p_next), positions, BLOCK_K - 1), 0,
                                  _min_combine, reverse=True)
    mass = after - (run_end - positions).to(tl.float32) * p + (positions - run_start + 1).to(tl.float32) * p
    return mass + tl.where(p_after < p, p_after, 0.0)


@triton.jit
def _support_loss_kernel(teacher_ptr, at_ids_ptr, lse_tempered_ptr, counted_ptr, scale_ptr, threshold_ptr,
                         kd_ptr, grad_ids_ptr, grad_lse_tempered_ptr,
                         k, stride_teacher, stride_ids, stride_grad, vocab_size, inv_temperature,
                         log_beta, log_one_minus_beta, beta, lam, log_lam, log_one_minus_lam, tail_floor,
                         alpha, adaptive_eps, control_slope, DIVERGENCE: tl.constexpr, TAIL: tl.constexpr,
                         SAMPLED: tl.constexpr, VOCAB_NORMALIZED: tl.constexpr, GRADS: tl.constexpr,
                         BLOCK_K: tl.constexpr, COMPARE_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_K)
    in_k = offsets < k
    t = tl.load(teacher_ptr + row.to(tl.int64) * stride_teacher + offsets, mask=in_k,
                other=float("-inf")).to(tl.float32)
    valid = in_k & (t > float("-inf"))
    s = tl.load(at_ids_ptr + row.to(tl.int64) * stride_ids + offsets, mask=in_k, other=0.0) * inv_temperature
    num_valid = tl.sum(valid.to(tl.int32), axis=0)
    if VOCAB_NORMALIZED:
        lse_tempered = tl.load(lse_tempered_ptr + row)
        lp = tl.where(valid, t, 0.0)
        lq = tl.where(valid, s - lse_tempered, 0.0)
    else:
        t_max = tl.max(tl.where(valid, t, float("-inf")), axis=0)
        t_max = tl.where(num_valid > 0, t_max, 0.0)
        s_max = tl.max(tl.where(valid, s, float("-inf")), axis=0)
        # no finite student logit on the valid ids (or no valid id): equal logits, no gradient to them
        flat = s_max == float("-inf")
        s = tl.where(flat, 0.0, s)
        s_max = tl.where(flat, 0.0, s_max)
        t_lse = t_max + tl.log(tl.sum(tl.where(valid, tl.exp(t - t_max), 0.0), axis=0))
        s_lse = s_max + tl.log(tl.sum(tl.where(valid, tl.exp(s - s_max), 0.0), axis=0))
        lp = tl.where(valid, t - t_lse, 0.0)
        lq = tl.where(valid, s - s_lse, 0.0)
    if DIVERGENCE == 6:  # adaptive_kl: forward and reverse KL terms, weighted once the gaps are known
        term, u = _bin_terms(lp, lq, 0, log_beta, log_one_minus_beta, beta, lam, log_lam, log_one_minus_lam)
        term_r, u_r = _bin_terms(lp, lq, 1, log_beta, log_one_minus_beta, beta, lam, log_lam, log_one_minus_lam)
        term_r = tl.where(valid, term_r, 0.0)
        u_r = tl.where(valid, u_r, 0.0)
    else:
        term, u = _bin_terms(lp, lq, DIVERGENCE, log_beta, log_one_minus_beta, beta, lam, log_lam,
                             log_one_minus_lam)
    if SAMPLED:
        threshold = tl.load(threshold_ptr + row)
        inverse_pi = 1.0 / _neg_expm1(-tl.exp(lp - threshold))  # 1 where the threshold is -inf
        q_cv = tl.exp(lq)
        term = (term - control_slope * (q_cv - tl.exp(lp))) * inverse_pi
        u = (u - control_slope * q_cv) * inverse_pi
    term = tl.where(valid, term, 0.0)
    u = tl.where(valid, u, 0.0)
    divergence = tl.sum(term, axis=0)
    q = tl.where(valid, tl.exp(lq), 0.0)
    if TAIL:
        # no tail bin where the ids cover the vocab, or where the row has an invalid entry (the
        # teacher ran out of finite columns: its tail mass is exactly 0)
        has_tail = (num_valid == k) & (num_valid < vocab_size)
        p_max = tl.max(tl.where(valid, lp, float("-inf")), axis=0)
        p_max = tl.where(num_valid > 0, p_max, 0.0)
        log_covered_p = p_max + tl.log(tl.sum(tl.where(valid, tl.exp(lp - p_max), 0.0), axis=0))
        q_max = tl.max(tl.where(valid, lq, float("-inf")), axis=0)
        q_max = tl.where(q_max > float("-inf"), q_max, 0.0)  # no valid id, or q = 0 on all of them
        log_covered_q = q_max + tl.log(tl.sum(tl.where(valid, tl.exp(lq - q_max), 0.0), axis=0))
        tail_p = tl.maximum(_neg_expm1(tl.minimum(log_covered_p, 0.0)), tail_floor)
        uncovered_q = _neg_expm1(tl.minimum(log_covered_q, 0.0))
        uncovered_q = tl.where(log_covered_q >= 0.0, 0.0, uncovered_q)
        unfloored = uncovered_q > tail_floor
        tail_q = tl.maximum(uncovered_q, tail_floor)
        if DIVERGENCE == 6:
            term_tail, u_tail = _bin_terms(tl.log(tail_p), tl.log(tail_q), 0, log_beta, log_one_minus_beta,
                                           beta, lam, log_lam, log_one_minus_lam)
        else:
            term_tail, u_tail = _bin_terms(tl.log(tail_p), tl.log(tail_q), DIVERGENCE, log_beta, log_one_minus_beta,
                                           beta, lam, log_lam, log_one_minus_lam)
        term_tail = tl.where(has_tail, term_tail, 0.0)
        u_tail = tl.where(has_tail, u_tail, 0.0)
        divergence += term_tail
        if DIVERGENCE == 6:
            term_tail_r, u_tail_r = _bin_terms(tl.log(tail_p), tl.log(tail_q), 1, log_beta, log_one_minus_beta,
                                               beta, lam, log_lam, log_one_minus_lam)
            term_tail_r = tl.where(has_tail, term_tail_r, 0.0)
            u_tail_r = tl.where(has_tail, u_tail_r, 0.0)
            p_tail = tl.where(has_tail, tail_p, 0.0)
            q_tail = tl.where(has_tail, tail_q, 0.0)
    else:
        u_tail = 0.0
    if DIVERGENCE == 6:
        p = tl.where(valid, tl.exp(lp), 0.0)
        gap = tl.abs(p - q)
        if TAIL:
            shift = 0.0
        else:
            shift = t_lse
            p_tail = 0.0
            q_tail = 0.0
            term_tail_r = 0.0
            u_tail_r = 0.0
        teacher_row_ptr = teacher_ptr + row.to(tl.int64) * stride_teacher
        if _is_descending(p, teacher_row_ptr, k, shift, BLOCK_K):
            mass = _mass_at_or_before_descending(p, p_tail, BLOCK_K)
        else:
            mass = _mass_at_or_before(p, p_tail, teacher_row_ptr, k, shift, BLOCK_K, COMPARE_BLOCK)
        in_tail = mass <= alpha
        tail_bin_in_tail = (tl.sum(tl.where(p <= p_tail, p, 0.0), axis=0) + p_tail) <= alpha
        gap_tail_bin = tl.abs(p_tail - q_tail)
        gap_tail = tl.sum(tl.where(valid & in_tail, gap, 0.0), axis=0) + tl.where(tail_bin_in_tail, gap_tail_bin, 0.0)
        gap_head = tl.sum(tl.where(valid & (mass > alpha), gap, 0.0), axis=0) + tl.where(tail_bin_in_tail, 0.0,
                                                                                         gap_tail_bin)
        gap_total = gap_head + gap_tail + adaptive_eps
        # a zero weight drops its term, even an infinite forward KL
        head = tl.where(gap_head > 0.0, gap_head * divergence, 0.0)
        divergence = (head + gap_tail * (tl.sum(term_r, axis=0) + term_tail_r)) / gap_total
        u = (gap_head * u + gap_tail * u_r) / gap_total
        u_tail = (gap_head * u_tail + gap_tail * u_tail_r) / gap_total
    if TAIL:
        # ∂ log q_T / ∂ log q_i = −q_i / (1 − Σ q); a floored tail is a constant
        tail_weight = tl.where(has_tail & unfloored, u_tail / tl.where(unfloored, uncovered_q, 1.0), 0.0)
        w = u - tail_weight * q
    elif SAMPLED:
        w = u
    else:
        w = u - q * tl.sum(u, axis=0)
    counted = tl.load(counted_ptr + row) != 0
    tl.store(kd_ptr + row, tl.where(counted, divergence, 0.0))
    if GRADS:
        scale = tl.where(counted, tl.load(scale_ptr + row), 0.0)
        if not VOCAB_NORMALIZED:
            w = tl.where(flat, 0.0, w)
        w = tl.where(valid, w, 0.0) * scale
        tl.store(grad_ids_ptr + row.to(tl.int64) * stride_grad + offsets, w * inv_temperature, mask=in_k)
        if TAIL:
            tl.store(grad_lse_tempered_ptr + row, -tl.sum(w, axis=0))
        if SAMPLED:
            if DIVERGENCE == 0:
                tl.store(grad_lse_tempered_ptr + row, scale)
            else:
                tl.store(grad_lse_tempered_ptr + row, -tl.sum(w, axis=0))


def _log(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


def support_loss(teacher_logprobs: torch.Tensor, logits_at_ids: torch.Tensor, lse_tempered: torch.Tensor,
                 counted: torch.Tensor, grad_scale, options, vocab_size: int,
                 log_threshold: Optional[torch.Tensor] = None):
    """Per-row divergence ``[N]`` float32 (0 on rows not counted), and with ``grad_scale [N]``
    (d objective / d row divergence) the gradients w.r.t. ``logits_at_ids [N, k]`` (raw,
    un-tempered) and ``lse_tempered [N]`` (None in renormalized mode). Support "sampled" reads
    the samples' ``log_threshold [N]`` float32."""
    rows, k = teacher_logprobs.shape
    device = teacher_logprobs.device
    divergence = options.divergence
    if divergence == "jsd" and options.beta in (0.0, 1.0):
        divergence = "forward_kl" if options.beta == 0.0 else "reverse_kl"
    if divergence.startswith("skewed_") and options.skew_lambda == 0.0:  # the mixture is q (forward) or p
        divergence = divergence[len("skewed_"):]
    tail, sampled = options.support == "tail", options.support == "sampled"
    control_slope = control_variate_slope(divergence, options.beta, options.skew_lambda) if sampled else 0.0
    grads = grad_scale is not None
    kd = torch.empty(rows, dtype=torch.float32, device=device)
    grad_ids = torch.empty(rows, k, dtype=torch.float32, device=device) if grads else kd
    grad_lse = torch.empty(rows, dtype=torch.float32, device=device) if grads and (tail or sampled) else None
    logits_at_ids = logits_at_ids.float()
    if rows:
        beta, lam = float(options.beta), float(options.skew_lambda)
        block_k = triton.next_power_of_2(k)
        _support_loss_kernel[(rows,)](
            teacher_logprobs, logits_at_ids, lse_tempered, counted, grad_scale if grads else kd,
            log_threshold if sampled else kd, kd, grad_ids, grad_lse if grad_lse is not None else kd,
            k, teacher_logprobs.stride(0), logits_at_ids.stride(0), grad_ids.stride(0) if grads else 0, vocab_size,
            1.0 / options.temperature, _log(beta), _log(1.0 - beta), beta, lam, _log(lam), _log(1.0 - lam),
            TAIL_FLOOR, float(options.adaptive_alpha), ADAPTIVE_EPS, control_slope, DIVERGENCE=_SELECTOR[divergence],
            TAIL=tail, SAMPLED=sampled, VOCAB_NORMALIZED=tail or sampled, GRADS=grads, BLOCK_K=block_k,
            COMPARE_BLOCK=min(_COMPARE_BLOCK, block_k),
            num_warps=4 if k <= 256 else 8)
    return kd, (grad_ids if grads else None), grad_lse
