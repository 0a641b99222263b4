"""Sampled sparse KD in plain PyTorch: the teacher's Gumbel noise and the unbiased estimator of a
full-vocab divergence from Gumbel-top-n samples (docs/DESIGN.md, "Sampled sparse KD").

The noise. Token v of row r gets ``G = −log(E)``, ``E = −log1p(−w)``, ``w = (m + ½) · 2⁻³²`` with
``m`` 32 bits hashed from (seed, r, v) and nothing else, so every backend and every recompute
draws the same samples:

- ``row_key = mix32(mix32(seed_key ^ r_lo) + r_hi)``, ``seed_key = mix32(s_lo ^ mix32(s_hi ^
  SEED_SALT))`` (``x_lo`` / ``x_hi`` the low and high 32 bits, ``mix32`` the lowbias32 finalizer);
- one hash a pair of columns: ``h = pair_mix(row_key + (v >> 1))`` (``pair_mix``: mix32 without its
  first xorshift); the pair's even column takes ``h``'s high 16 bits, the odd one its low 16 as the
  high half of ``m`` (the "coarse" bits: all the teacher matmul's epilogue computes);
- the low half of ``m``: ``mix32(h ^ (FINE_SALT + (v & 1))) >> 16``.

``w`` is uniform on (0, 1) up to its 2⁻³² grid, so ``E`` is Exp(1) and ``G`` standard Gumbel
(truncated at ``G ≤ ln 2³³ ≈ 22.9``: a token more than 22.9 nats below the threshold key is never
drawn). Small ``w`` is a large ``G``; ``w ≥ coarse · 2⁻¹⁶`` always.

The estimator. With keys ``κ_v = log p_v + G_v`` the n samples S are the n largest keys and
``κ*`` the (n+1)-th; given κ* each sample's inclusion probability is
``π_i = P(log p_i + G > κ*) = 1 − exp(−exp(log p_i − κ*))`` and for any per-token ``f``,
``Σ_{i∈S} p_i f_i / π_i`` is an unbiased estimate of ``Σ_v p_v f_v`` (Kool, van Hoof, Welling
2019, "Stochastic Beams and Where to Find Them", section 4; Duffield, Lund, Thorup's priority
sampling). A divergence ``D = Σ_v t(p_v, q_v)`` summed over the vocab (every one of SPEC.md's
table but adaptive_kl) is such a sum with ``f = t / p``, so ``Σ_{i∈S} t'(p_i, q_i) / π_i`` estimates
it without bias for any ``t'`` whose sum over the vocab equals D's:

- forward_kl: ``t' = t = p (log p − log q)``; its gradient's dense part ``q · Σ_S p_i / π_i`` is
  taken at its mean ``q`` (``Σ_v p_v = 1``), so only the teacher's probabilities are sampled:
  ``∂/∂s_i = −p_i / π_i``, ``∂/∂lse_τ = 1``;
- reverse_kl, skewed_reverse_kl: ``t' = t − c (q − p)`` with ``c = ∂t/∂q`` at ``q = p``
  (`control_variate_slope`; ``Σ_v (q_v − p_v) = 0``): each term ≥ 0, the estimate and its
  gradient vanish where the student matches the teacher;
- jsd (β in (0, 1)), skewed_forward_kl, tvd: ``t' = t``.
Gradients otherwise: ``u_i = ∂t'/∂log q_i``, ``∂/∂s_i = u_i / π_i``, ``∂/∂lse_τ = −Σ_i u_i / π_i``.
"""
from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
HASH_M1 = 0x7FEB352D  # lowbias32's multipliers
HASH_M2 = 0x846CA68B
SEED_SALT = 0x9E3779B9
FINE_SALT = 0x68E31DA4
# the noises' discrete grid: m has 32 bits, the epilogue's coarse part 16 of them
NOISE_BITS = 32
COARSE_BITS = 16
# divergences with an unbiased sampled form: those of SPEC.md's table that are a sum over tokens
# (adaptive_kl's head / tail split and its gap ratio are not)
SAMPLED_DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "skewed_forward_kl", "skewed_reverse_kl", "tvd")


def mix32_int(x: int) -> int:
    """lowbias32 of a Python int's low 32 bits (host side: the seed's key)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * HASH_M1) & MASK32
    x ^= x >> 15
    x = (x * HASH_M2) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The 32-bit key of a seed in [0, 2⁶⁴)."""
    return mix32_int((seed & MASK32) ^ mix32_int((seed >> 32) ^ SEED_SALT))


def _mul32(x: torch.Tensor, multiplier: int) -> torch.Tensor:
    """``x · multiplier mod 2³²`` for int64 tensors holding 32-bit values (no int64 overflow)."""
    low = x * (multiplier & 0xFFFF)
    high = ((x * (multiplier >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def _pair_mix(x: torch.Tensor) -> torch.Tensor:
    x = _mul32(x & MASK32, HASH_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, HASH_M2)
    return x ^ (x >> 16)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x & MASK32
    return _pair_mix(x ^ (x >> 16))


def row_keys(seed: int, rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]`` 32-bit keys of the global row indices ``rows`` (int64, ≥ 0)."""
    rows = rows.long()
    return _mix32(_mix32(seed_key(seed) ^ (rows & MASK32)) + (rows >> 32))


def noise_bits(seed: int, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``m`` int64 ``[R, C]`` (32-bit values) of rows ``[R]`` × columns ``[C]`` (global ids)."""
    columns = columns.long()
    h = _pair_mix(row_keys(seed, rows)[:, None] + (columns >> 1)[None, :])
    odd = (columns & 1)[None, :]
    coarse = torch.where(odd == 1, h & 0xFFFF, h >> 16)
    fine = _mix32(h ^ (FINE_SALT + odd)) >> 16
    return (coarse << 16) | fine


def gumbel_noise(seed: int, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """G float64 ``[R, C]``: the standard Gumbel noise of rows ``[R]`` × columns ``[C]``."""
    w = (noise_bits(seed, rows, columns).double() + 0.5) * 2.0 ** -NOISE_BITS
    return -torch.log(-torch.log1p(-w))


def log_inclusion(logprobs: torch.Tensor, log_threshold: torch.Tensor) -> torch.Tensor:
    """``log π_i = log(1 − exp(−exp(log p_i − t)))`` ``[N, n]`` for log-probs ``[N, n]`` and each
    row's threshold ``t = κ* − lse`` ``[N]`` (−inf: every column is a sample, π = 1). −inf where
    the log-prob is −inf (a missing entry)."""
    logprobs = logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))
    excess = logprobs - log_threshold.to(logprobs.dtype).unsqueeze(-1)
    excess = torch.where(torch.isneginf(logprobs), -math.inf, excess)  # not -inf - (-inf)
    return torch.log(-torch.expm1(-torch.exp(excess)))


def _resolved(divergence: str, beta: float) -> str:
    if divergence == "jsd" and beta in (0.0, 1.0):
        return "forward_kl" if beta == 0.0 else "reverse_kl"
    if divergence not in SAMPLED_DIVERGENCES:
        raise ValueError(f"divergence: {divergence!r} has no unbiased sampled form; expected one of "
                         f"{', '.join(SAMPLED_DIVERGENCES)}")
    return divergence


def _dense_at_mean(divergence: str, beta: float, skew_lambda: float) -> bool:
    """forward_kl (jsd at β = 0, skewed_forward_kl at λ = 0): its dense gradient part is taken at its mean."""
    resolved = _resolved(divergence, beta)
    return resolved == "forward_kl" or (resolved == "skewed_forward_kl" and skew_lambda == 0.0)


def control_variate_slope(divergence: str, beta: float = 0.5, skew_lambda: float = 0.1) -> float:
    """c of the sampled term ``t − c (q − p)``: ``∂t/∂q`` at ``q = p`` for reverse_kl and
    skewed_reverse_kl (jsd at β = 1), 0 for the others."""
    divergence = _resolved(divergence, beta)
    return {"reverse_kl": 1.0, "skewed_reverse_kl": 1.0 - skew_lambda}.get(divergence, 0.0)


def _log_weight(weight: float) -> float:
    return math.log(weight) if weight > 0 else -math.inf


def sampled_bin_terms(log_p: torch.Tensor, log_q: torch.Tensor, divergence: str, beta: float = 0.5,
                      skew_lambda: float = 0.1):
    """(t', u) per bin, same shape as ``log_p`` / ``log_q``: the sampled term of the module
    docstring (SPEC.md's per-bin divergence less `control_variate_slope`'s ``c (q − p)``) and
    ``u = ∂t'/∂log q`` in closed form."""
    divergence = _resolved(divergence, beta)
    p, q = torch.exp(log_p), torch.exp(log_q)
    if divergence == "forward_kl":
        return p * (log_p - log_q), -p
    if divergence == "reverse_kl":
        return q * (log_q - log_p) - q + p, q * (log_q - log_p)
    if divergence == "jsd":
        log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
        return (beta * p * (log_p - log_m) + (1.0 - beta) * q * (log_q - log_m),
                (1.0 - beta) * q * (log_q - log_m))
    lam = skew_lambda
    if divergence == "skewed_forward_kl":
        log_mix = torch.logaddexp(_log_weight(lam) + log_p, _log_weight(1.0 - lam) + log_q)
        return p * (log_p - log_mix), -(1.0 - lam) * p * torch.exp(log_q - log_mix)
    if divergence == "skewed_reverse_kl":
        log_mix = torch.logaddexp(_log_weight(1.0 - lam) + log_p, _log_weight(lam) + log_q)
        return (q * (log_q - log_mix) - (1.0 - lam) * (q - p),
                q * (log_q - log_mix + lam * (1.0 - torch.exp(log_q - log_mix))))
    return 0.5 * torch.abs(p - q), -0.5 * q * torch.sign(p - q)


def _masked(log_p: torch.Tensor, log_q: torch.Tensor, log_pi: torch.Tensor):
    valid = torch.isfinite(log_p)
    return valid, torch.where(valid, log_p, 0.0), torch.where(valid, log_q, 0.0), torch.where(valid, log_pi, 0.0)


def sampled_row_divergence(log_p: torch.Tensor, values: torch.Tensor, lse_tempered: torch.Tensor,
                           log_pi: torch.Tensor, divergence: str, beta: float = 0.5,
                           skew_lambda: float = 0.1) -> torch.Tensor:
    """``[N]`` the unbiased estimate ``Σ_i t'(p_i, q_i) / π_i`` of each row's full-vocab divergence,
    differentiable: the teacher's ``log_p`` and ``log_pi`` ``[N, n]``, the student's ``values
    [N, n]`` (``s_i = z_i / τ`` at the samples) and ``lse_tempered [N]`` (``logsumexp(z / τ)`` over
    the vocab), ``log q_i = s_i − lse_τ``. Entries with ``log_p = −inf`` (missing) contribute
    exactly 0. forward_kl's gradient takes its dense part at its mean (module docstring): the
    value is the estimate, ``∂/∂lse_τ = 1``."""
    valid, log_p, log_q, log_pi = _masked(log_p, values - lse_tempered.unsqueeze(-1), log_pi)
    term, _ = sampled_bin_terms(log_p, log_q, divergence, beta, skew_lambda)
    inverse_pi = torch.where(valid, torch.exp(-log_pi), 0.0)
    estimate = (term * inverse_pi).sum(dim=-1)
    if _dense_at_mean(divergence, beta, skew_lambda):
        weight_sum = (torch.exp(log_p) * inverse_pi).sum(dim=-1).detach()
        estimate = estimate + (1.0 - weight_sum) * (lse_tempered - lse_tempered.detach())
    return estimate


def sampled_gradients(log_p: torch.Tensor, log_q: torch.Tensor, log_pi: torch.Tensor, divergence: str,
                      beta: float = 0.5, skew_lambda: float = 0.1):
    """The gradients of `sampled_row_divergence` in closed form: (``∂/∂s_i`` ``[N, n]``, 0 where
    missing; ``∂/∂lse_τ`` ``[N]``), where ``s_i = z_i / τ`` and ``log q_i = s_i − lse_τ``."""
    valid, log_p, log_q, log_pi = _masked(log_p, log_q, log_pi)
    _, u = sampled_bin_terms(log_p, log_q, divergence, beta, skew_lambda)
    at_values = torch.where(valid, u * torch.exp(-log_pi), 0.0)
    if _dense_at_mean(divergence, beta, skew_lambda):
        return at_values, torch.ones_like(at_values[..., 0])
    return at_values, -at_values.sum(dim=-1)
