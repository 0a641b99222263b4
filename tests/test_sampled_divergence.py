"""The unbiased sampled estimate of a full-vocab divergence from Gumbel-top-n teacher samples
(kd_kernels/sampling.py, `reference.sampled_divergence`): its mean over many draws equals the
full-vocab divergence and its gradient's mean the full-vocab gradient, within their standard
errors; the closed-form gradients the fused student kernel will apply equal autograd's; the
estimate is exact when every column is sampled."""
import math

import pytest
import torch

from kd_kernels import reference, sampling
from kd_kernels.options import DivergenceOptions
from kd_kernels.support import bin_divergence

DIVERGENCES = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", dict(beta=0.5)), ("jsd", dict(beta=1.0)),
               ("tvd", {}), ("skewed_forward_kl", dict(skew_lambda=0.3)), ("skewed_reverse_kl", dict(skew_lambda=0.3))]
IDS = [name + "".join(f"-{value}" for value in extra.values()) for name, extra in DIVERGENCES]


def full_vocab(teacher: torch.Tensor, student: torch.Tensor, options: DivergenceOptions):
    """The exact divergence of one row over every column (each its own bin; support.py's
    per-bin table) and its gradient w.r.t. the student logits."""
    student = student.double().clone().requires_grad_()
    log_p = torch.log_softmax(teacher.double() / options.temperature, -1)[None]
    log_q = torch.log_softmax(student / options.temperature, -1)[None]
    value = bin_divergence(log_p, log_q, torch.ones_like(log_p, dtype=torch.bool), options)[0]
    value.backward()
    return value.detach(), student.grad


def rows_of(teacher: torch.Tensor, student: torch.Tensor, draws: int, num_samples: int, options, seed: int):
    """Per-draw estimates ``[draws]`` and gradients ``[draws, V]``: rows of the same teacher and
    student row, each its own noise."""
    samples = reference.teacher_sample_from_logits(teacher.expand(draws, -1), num_samples, options.temperature,
                                                   seed=seed)
    logits = student.double().expand(draws, -1).clone().requires_grad_()
    estimates = reference.sampled_divergence_from_logits(logits, samples, None, options)
    estimates.sum().backward()
    return estimates.detach(), logits.grad


@pytest.mark.parametrize("divergence, extra", DIVERGENCES, ids=IDS)
def test_the_estimate_and_its_gradient_are_unbiased(divergence, extra):
    generator = torch.Generator().manual_seed(1)
    teacher = 2.0 * torch.randn(40, generator=generator)
    student = teacher + 1.0 * torch.randn(40, generator=generator)
    options = DivergenceOptions(divergence=divergence, temperature=0.8, reduction="none", **extra)
    exact, exact_gradient = full_vocab(teacher, student, options)
    draws = 20_000
    estimates, gradients = rows_of(teacher, student, draws, 4, options, seed=5)
    error = estimates.std() / math.sqrt(draws)
    assert abs(estimates.mean() - exact) < 4 * error
    assert 4 * error < 0.1 * exact  # the test has power: a 10 % bias would show
    gradient_error = gradients.std(0) / math.sqrt(draws)
    assert ((gradients.mean(0) - exact_gradient).abs() <= 5 * gradient_error + 1e-9).all()


def test_a_biased_estimate_would_fail_the_test():
    # the same draws with the threshold off by one (the n-th key, the last sample's own, for the
    # (n+1)-th: π too large, samples underweighted): biased, and the test sees it
    generator = torch.Generator().manual_seed(1)
    teacher = 2.0 * torch.randn(40, generator=generator)
    student = teacher + 1.0 * torch.randn(40, generator=generator)
    options = DivergenceOptions(temperature=0.8, reduction="none")
    exact, _ = full_vocab(teacher, student, options)
    samples = reference.teacher_sample_from_logits(teacher.expand(20_000, -1), 4, 0.8, seed=5)
    fewer = reference.teacher_sample_from_logits(teacher.expand(20_000, -1), 3, 0.8, seed=5)
    samples.log_threshold = fewer.log_threshold
    estimates = reference.sampled_divergence_from_logits(student.double().expand(20_000, -1), samples, None, options)
    assert abs(estimates.mean() - exact) > 10 * estimates.std() / math.sqrt(20_000)


@pytest.mark.parametrize("divergence, extra", DIVERGENCES, ids=IDS)
def test_closed_form_gradients_equal_autograd(divergence, extra):
    generator = torch.Generator().manual_seed(2)
    log_p = torch.log_softmax(torch.randn(6, 30, generator=generator, dtype=torch.float64), -1)[:, :5].clone()
    log_p[2, 3:] = -math.inf  # missing entries
    values = torch.randn(6, 5, generator=generator, dtype=torch.float64).requires_grad_()
    lse = (2 + torch.rand(6, generator=generator, dtype=torch.float64)).requires_grad_()
    log_pi = sampling.log_inclusion(log_p, torch.full((6,), -3.0, dtype=torch.float64))
    estimate = sampling.sampled_row_divergence(log_p, values, lse, log_pi, divergence, **extra)
    scale = torch.rand(6, generator=generator, dtype=torch.float64)
    at_values, at_lse = torch.autograd.grad((estimate * scale).sum(), (values, lse))
    closed_values, closed_lse = sampling.sampled_gradients(log_p, values.detach() - lse.detach()[:, None], log_pi,
                                                           divergence, **extra)
    assert torch.allclose(at_values, closed_values * scale[:, None], atol=1e-12, rtol=1e-10)
    assert torch.allclose(at_lse, closed_lse * scale, atol=1e-12, rtol=1e-10)
    assert (at_values[2, 3:] == 0).all() and torch.isfinite(estimate).all()


@pytest.mark.parametrize("divergence, extra", DIVERGENCES, ids=IDS)
def test_every_column_sampled_gives_the_exact_divergence(divergence, extra):
    generator = torch.Generator().manual_seed(3)
    teacher = 2.0 * torch.randn(8, generator=generator)
    student = torch.randn(8, generator=generator)
    options = DivergenceOptions(divergence=divergence, temperature=1.5, reduction="none", **extra)
    exact, exact_gradient = full_vocab(teacher, student, options)
    estimates, gradients = rows_of(teacher, student, 3, 8, options, seed=1)
    assert torch.allclose(estimates, exact.expand(3), atol=1e-12)
    assert torch.allclose(gradients, exact_gradient.expand(3, -1), atol=1e-12)
    # n > V*: missing entries (-inf / id 0) change nothing
    more, more_gradients = rows_of(teacher, student, 3, 11, options, seed=1)
    assert torch.allclose(more, estimates, atol=1e-12) and torch.allclose(more_gradients, gradients, atol=1e-12)


@pytest.mark.parametrize("divergence, extra", [d for d in DIVERGENCES if "forward_kl" not in d[0]],
                         ids=[i for i in IDS if "forward_kl" not in i])
def test_the_estimate_and_its_gradient_vanish_where_the_student_is_the_teacher(divergence, extra):
    # forward_kl's and skewed_forward_kl's gradients (no control variate) vanish only on average
    generator = torch.Generator().manual_seed(4)
    teacher = 2.0 * torch.randn(30, generator=generator)
    options = DivergenceOptions(divergence=divergence, temperature=0.7, reduction="none", **extra)
    estimates, gradients = rows_of(teacher, teacher, 50, 5, options, seed=2)
    assert estimates.abs().max() < 1e-12 and gradients.abs().max() < 1e-12


def test_control_variate_terms_are_never_negative():
    generator = torch.Generator().manual_seed(5)
    log_p = torch.log_softmax(3 * torch.randn(400, generator=generator, dtype=torch.float64), -1)
    log_q = torch.log_softmax(3 * torch.randn(400, generator=generator, dtype=torch.float64), -1)
    for divergence in ("reverse_kl", "skewed_reverse_kl"):
        term, _ = sampling.sampled_bin_terms(log_p, log_q, divergence, skew_lambda=0.2)
        assert term.min() >= -1e-15
        assert sampling.control_variate_slope(divergence, skew_lambda=0.2) != 0
    assert sampling.control_variate_slope("jsd", beta=1.0) == 1.0
    assert sampling.control_variate_slope("forward_kl") == 0.0


def test_adaptive_kl_has_no_sampled_form():
    with pytest.raises(ValueError, match="divergence: 'adaptive_kl' has no unbiased sampled form"):
        sampling.sampled_bin_terms(torch.zeros(1), torch.zeros(1), "adaptive_kl")


def test_the_loss_reduces_like_the_other_supports():
    # ignored rows count for nothing, CE is the reference's, the mean divides by the counted rows
    generator = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(6, 8, generator=generator), torch.randn(30, 8, generator=generator)
    samples = reference.teacher_sample(torch.randn(6, 8, generator=generator), weight, 5, 1.0, seed=3)
    labels = torch.tensor([1, -100, 4, 29, -100, 0])
    options = DivergenceOptions(ce_weight=0.5, kd_weight=2.0, reduction="none")
    per_row = reference.sampled_divergence(hidden, weight, samples, labels, options)
    assert (per_row[[1, 4]] == 0).all()
    kd = reference.sampled_divergence(hidden, weight, samples, None, DivergenceOptions(reduction="none"))
    ce = reference.topk_divergence(hidden, weight, reference.teacher_topk(hidden, weight, 2), labels,
                                   DivergenceOptions(kd_weight=0.0, ce_weight=1.0, reduction="none"))
    counted = labels != -100
    assert torch.allclose(per_row[counted], (2.0 * kd + 0.5 * ce)[counted])
    mean = reference.sampled_divergence(hidden, weight, samples, labels,
                                        DivergenceOptions(ce_weight=0.5, kd_weight=2.0))
    assert torch.allclose(mean, per_row.sum() / 4)
