"""support="sampled" of the student loss: the Triton kernel (fused with the lm_head, and from
logits) against the float64 reference, losses and gradients; its estimate's mean over seeds
equals the full-vocab divergence; the inputs and divergences it refuses.

On CPU the kernels run under TRITON_INTERPRET=1 (fp32, tiny shapes); the `gpu` test runs a
real vocabulary in bf16."""
import math

import pytest
import torch

import kd_kernels as kd
from kd_kernels.sampling import SAMPLED_DIVERGENCES

from helpers import HAS_CUDA, relative_error

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _problem(n=29, h=16, v=203, samples=6, vocab_size=200, seed=0, temperature=2.0, device=DEVICE,
             dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=generator).to(device, dtype)
    weight = torch.randn(v, h, generator=generator).to(device, dtype)
    bias = torch.randn(v, generator=generator).to(device, dtype)
    teacher_hidden = torch.randn(n, h, generator=generator).to(device)
    teacher_weight = torch.randn(v, h, generator=generator).to(device)
    teacher = kd.teacher_sample(teacher_hidden, teacher_weight, samples, seed=seed + 11, temperature=temperature,
                                vocab_size=vocab_size, backend="torch")
    labels = torch.randint(0, vocab_size, (n,), generator=generator)
    labels[torch.rand(n, generator=generator) < 0.2] = -100
    return hidden, weight, bias, teacher, labels.to(device)


def _compare(problem, tolerance, chunk_rows=16, from_logits=False, **options):
    """The triton backend against the float64 torch backend: the loss and the gradients of
    every input, with an upstream gradient != 1 (per row for reduction="none")."""
    hidden, weight, bias, teacher, labels = problem
    kwargs = {"temperature": 2.0, "ce_weight": 0.5, "vocab_size": 200, "support": "sampled", **options}
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    if from_logits:
        leaves = [(leaves[0] @ leaves[1].T + leaves[2]).detach().requires_grad_()]
        leaves64 = [leaves[0].detach().double().requires_grad_()]
        expected = kd.topk_divergence_from_logits(leaves64[0], teacher, labels, backend="torch", **kwargs)
        got = kd.topk_divergence_from_logits(leaves[0], teacher, labels, backend="triton", **kwargs)
    else:
        expected = kd.topk_divergence(leaves64[0], leaves64[1], teacher, labels, bias=leaves64[2], backend="torch",
                                      **kwargs)
        got = kd.topk_divergence(leaves[0], leaves[1], teacher, labels, bias=leaves[2], backend="triton",
                                 chunk_rows=chunk_rows, **kwargs)
    assert relative_error(got, expected) <= tolerance
    upstream = torch.rand_like(expected) + 0.5
    expected_grads = torch.autograd.grad(expected, leaves64, upstream)
    for g, r in zip(torch.autograd.grad(got, leaves, upstream.float()), expected_grads):
        assert relative_error(g, r) <= tolerance


@pytest.mark.parametrize("divergence", SAMPLED_DIVERGENCES)
def test_every_sampled_divergence_matches_the_reference(divergence):
    _compare(_problem(seed=SAMPLED_DIVERGENCES.index(divergence)), 1e-5, divergence=divergence, beta=0.3,
             skew_lambda=0.2)


@pytest.mark.parametrize("divergence, extra", [("jsd", dict(beta=0.0)), ("jsd", dict(beta=1.0)),
                                               ("skewed_forward_kl", dict(skew_lambda=0.0)),
                                               ("skewed_reverse_kl", dict(skew_lambda=0.0))])
def test_endpoints_that_are_another_divergence_match_the_reference(divergence, extra):
    _compare(_problem(seed=9), 1e-5, divergence=divergence, **extra)


@pytest.mark.parametrize("temperature, ce_weight, reduction", [(1.0, 0.5, "mean"), (2.0, 0.0, "sum"),
                                                                (0.7, 0.5, "none")])
def test_forward_kl_temperatures_reductions_and_from_logits(temperature, ce_weight, reduction):
    # τ = 1 (one dense term), τ != 1 with and without CE (one-read and two-pass gradients); the
    # estimate's 1/π weights make its terms (and their float32 rounding) larger than a top-k's
    problem = _problem(seed=7, temperature=temperature)
    for from_logits in (False, True):
        _compare(problem, 5e-5, from_logits=from_logits, temperature=temperature, ce_weight=ce_weight,
                 reduction=reduction)


def test_every_column_sampled_gives_the_exact_full_vocab_divergence():
    # n = V*: the threshold is -inf, every π is 1, the estimate is the divergence over the vocab
    hidden, weight, bias, _, labels = _problem(v=24, vocab_size=24)
    teacher_logits = torch.randn(hidden.shape[0], 24, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    samples = kd.teacher_sample_from_logits(teacher_logits, 24, seed=1, temperature=2.0, backend="torch")
    assert torch.isneginf(samples.log_threshold).all()
    logits = (hidden @ weight.T + bias)
    got = kd.topk_divergence_from_logits(logits, samples, divergence="reverse_kl", temperature=2.0,
                                         support="sampled", reduction="none", backend="triton")
    log_p = torch.log_softmax(teacher_logits.double() / 2.0, -1)
    log_q = torch.log_softmax(logits.double() / 2.0, -1)
    exact = (log_q.exp() * (log_q - log_p)).sum(-1)
    assert relative_error(got, exact) <= 1e-5


def test_the_kernel_estimate_is_unbiased_over_seeds():
    # one teacher and student row over 24 columns, 300 rows of it (each its own noise), 6 samples a row: the mean
    # of the kernel's per-row estimates is the full-vocab forward KL within 4 standard errors (a
    # 10 % bias would show), and the gradient's mean the full-vocab gradient (columns too
    # unlikely to be drawn in 300 rows aside: there the gradient is the dense part alone)
    generator = torch.Generator().manual_seed(1)
    teacher = 2.0 * torch.randn(24, generator=generator)
    student = teacher + torch.randn(24, generator=generator)
    draws = 300
    samples = kd.teacher_sample_from_logits(teacher.expand(draws, -1).contiguous().to(DEVICE), 6, seed=5,
                                            temperature=0.8, backend="torch")
    logits = student.expand(draws, -1).contiguous().to(DEVICE).requires_grad_()
    estimates = kd.topk_divergence_from_logits(logits, samples, temperature=0.8, support="sampled",
                                               reduction="none", backend="triton")
    (gradients,) = torch.autograd.grad(estimates.sum(), logits)
    exact_student = student.double().requires_grad_()
    log_p = torch.log_softmax(teacher.double() / 0.8, -1)
    exact = (log_p.exp() * (log_p - torch.log_softmax(exact_student / 0.8, -1))).sum()
    (exact_gradient,) = torch.autograd.grad(exact, exact_student)
    error = estimates.double().std() / math.sqrt(draws)
    assert abs(estimates.double().mean().item() - exact.item()) < 4 * error
    assert 4 * error < 0.1 * exact
    gradients = gradients.double().cpu()
    gradient_error = gradients.std(0) / math.sqrt(draws)
    assert ((gradients.mean(0) - exact_gradient).abs() <= 5 * gradient_error + 1e-4).all()


def test_refusals_name_support_and_divergence():
    hidden, weight, bias, samples, labels = _problem(n=4)
    topk = kd.teacher_topk(hidden, weight, 3, temperature=2.0, backend="torch")
    with pytest.raises(ValueError, match="adaptive_kl.*support='sampled'"):
        kd.topk_divergence(hidden, weight, samples, divergence="adaptive_kl", support="sampled", temperature=2.0)
    with pytest.raises(TypeError, match="support='sampled' expects a kd_kernels.TeacherSamples"):
        kd.topk_divergence(hidden, weight, topk, support="sampled", temperature=2.0)
    with pytest.raises(TypeError, match="support='tail' expects a kd_kernels.TopK.*support='sampled'"):
        kd.topk_divergence(hidden, weight, samples, support="tail", temperature=2.0)
    with pytest.raises(ValueError, match="temperature: the student temperature 1.0 differs"):
        kd.topk_divergence(hidden, weight, samples, support="sampled")
    bad = kd.TeacherSamples(samples.logprobs, samples.indices, samples.log_threshold.clone(), samples.lse,
                            samples.temperature, samples.seed)
    bad.log_threshold[1] = math.nan
    with pytest.raises(ValueError, match="teacher.log_threshold: contains NaN"):
        kd.topk_divergence(hidden, weight, bad, support="sampled", temperature=2.0)
    bad.log_threshold = samples.log_threshold[:3]
    with pytest.raises(ValueError, match=r"teacher.log_threshold: expected a float tensor of shape \[4\]"):
        kd.topk_divergence(hidden, weight, bad, support="sampled", temperature=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_sampled_loss_real_vocab_bf16(divergence):
    generator = torch.Generator().manual_seed(4)
    n, h, v = 1024, 1024, 151_936
    hidden = (0.5 * torch.randn(n, h, generator=generator)).cuda().bfloat16()
    weight = (0.05 * torch.randn(v, h, generator=generator)).cuda().bfloat16()
    teacher_hidden = (0.5 * torch.randn(n, h, generator=generator)).cuda().bfloat16()
    samples = kd.teacher_sample(teacher_hidden, weight, 12, seed=3)
    labels = torch.randint(0, v, (n,), generator=generator).cuda()
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    got = kd.topk_divergence(*leaves, samples, labels, divergence=divergence, support="sampled", ce_weight=0.3,
                             temperature=1.0)
    rows = slice(0, 64)  # the float64 reference holds [rows, V] logits
    leaves64 = [hidden[rows].double().requires_grad_(), weight.double().requires_grad_()]
    part = kd.TeacherSamples(samples.logprobs[rows], samples.indices[rows], samples.log_threshold[rows],
                             samples.lse[rows], samples.temperature, samples.seed)
    expected = kd.topk_divergence(*leaves64, part, labels[rows], divergence=divergence, support="sampled",
                                  ce_weight=0.3, reduction="none", backend="torch")
    got_rows = kd.topk_divergence(hidden[rows], weight, part, labels[rows], divergence=divergence,
                                  support="sampled", ce_weight=0.3, reduction="none")
    assert torch.isfinite(got)
    assert relative_error(got_rows, expected) <= 2e-2
    (grad_hidden,) = torch.autograd.grad(expected.sum(), leaves64[:1])
    rows_leaf = hidden[rows].clone().requires_grad_()
    got_rows = kd.topk_divergence(rows_leaf, weight, part, labels[rows], divergence=divergence, support="sampled",
                                  ce_weight=0.3, reduction="sum")
    (got_grad,) = torch.autograd.grad(got_rows, rows_leaf)
    assert relative_error(got_grad, grad_hidden) <= 3e-2
