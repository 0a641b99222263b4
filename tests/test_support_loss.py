"""The closed-form support kernel (divergence over the top-k bins and its gradient) against
torch autograd of the reference bin math in float64, including the edge cases."""
import math

import pytest
import torch

from helpers import HAS_CUDA, relative_error
from kd_kernels.options import DivergenceOptions
from kd_kernels.support import StudentRowStats, row_losses

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"
FUSED = ["forward_kl", "reverse_kl", "jsd", "skewed_forward_kl", "skewed_reverse_kl", "tvd", "adaptive_kl"]


def _rows(n=12, k=8, vocab=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    teacher_logits = 3 * torch.randn(n, vocab, generator=generator, dtype=torch.float64)
    teacher = torch.log_softmax(teacher_logits, -1).topk(k).values
    ids = teacher_logits.topk(k).indices
    student_logits = 3 * torch.randn(n, vocab, generator=generator, dtype=torch.float64)
    teacher[0, 5:] = -math.inf  # some invalid entries
    teacher[1, :] = -math.inf  # a row with none
    return teacher, student_logits.gather(1, ids), torch.logsumexp(student_logits / 2.0, -1)


def _reference(teacher, at_ids, lse_tempered, counted, scale, options, vocab):
    at_ids = at_ids.clone().requires_grad_()
    lse_tempered = lse_tempered.clone().requires_grad_()
    stats = StudentRowStats(at_ids / options.temperature, lse_tempered, None, torch.zeros(len(teacher)))
    kd, _ = row_losses(stats, teacher, None, counted, options, vocab)
    grads = torch.autograd.grad((kd * scale).sum(), (at_ids, lse_tempered), allow_unused=True)
    return kd.detach(), grads


def _fused(teacher, at_ids, lse_tempered, counted, scale, options, vocab):
    from kd_kernels.ops.support_loss import support_loss

    to = dict(device=DEVICE, dtype=torch.float32)
    return support_loss(teacher.to(**to), at_ids.to(**to), lse_tempered.to(**to), counted.to(DEVICE),
                        scale.to(**to), options, vocab)


def _assert_kernel_matches_autograd(teacher, at_ids, lse_tempered, counted, scale, options, vocab=40):
    kd, (grad_ids, grad_lse) = _reference(teacher, at_ids, lse_tempered, counted, scale, options, vocab)
    got_kd, got_ids, got_lse = _fused(teacher, at_ids, lse_tempered, counted, scale, options, vocab)
    assert relative_error(got_kd, kd) <= 1e-5
    assert relative_error(got_ids, grad_ids) <= 1e-5
    if options.support == "tail":
        assert relative_error(got_lse, grad_lse) <= 1e-5
    else:
        assert got_lse is None


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("divergence, beta, lam", [(d, 0.3, 0.2) for d in FUSED] + [
    ("jsd", 0.0, 0.1), ("jsd", 1.0, 0.1), ("skewed_forward_kl", 0.5, 0.0), ("skewed_forward_kl", 0.5, 1.0),
    ("skewed_reverse_kl", 0.5, 0.0), ("skewed_reverse_kl", 0.5, 1.0)])
def test_support_kernel_matches_autograd(divergence, beta, lam, support):
    teacher, at_ids, lse_tempered = _rows(seed=len(divergence))
    counted = torch.ones(len(teacher), dtype=torch.bool)
    counted[3] = False
    scale = torch.rand(len(teacher), dtype=torch.float64) + 0.5
    options = DivergenceOptions(divergence=divergence, support=support, temperature=2.0, beta=beta, skew_lambda=lam)
    _assert_kernel_matches_autograd(teacher, at_ids, lse_tempered, counted, scale, options)


def test_tail_without_a_tail_bin_and_at_the_floor():
    # k = V: no tail bin; and a teacher whose top-k covers all but 1e-12 of the mass (floored tail)
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    teacher_all = torch.log_softmax(logits, -1).sort(descending=True).values
    student = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    lse = torch.logsumexp(student / 2.0, -1)
    counted = torch.ones(4, dtype=torch.bool)
    scale = torch.ones(4, dtype=torch.float64)
    for name in FUSED:
        options = DivergenceOptions(divergence=name, support="tail", temperature=2.0)
        kd, (grad_ids, grad_lse) = _reference(teacher_all, student, lse, counted, scale, options, 6)
        got_kd, got_ids, got_lse = _fused(teacher_all, student, lse, counted, scale, options, 6)
        assert relative_error(got_kd, kd) <= 1e-5 and relative_error(got_ids, grad_ids) <= 1e-5, name
    peaked = torch.tensor([[0.0, -30.0, -30.0]], dtype=torch.float64)  # tail ~ 1e-13 < floor
    student_peaked = torch.tensor([[10.0, -20.0, -20.0]], dtype=torch.float64)
    lse_peaked = torch.tensor([10.0 / 2.0 + 1e-9], dtype=torch.float64)
    one = torch.ones(1, dtype=torch.bool)
    for name in FUSED:
        options = DivergenceOptions(divergence=name, support="tail", temperature=2.0)
        kd, (grad_ids, _) = _reference(peaked, student_peaked, lse_peaked, one, torch.ones(1, dtype=torch.float64),
                                       options, 1000)
        got_kd, got_ids, _ = _fused(peaked, student_peaked, lse_peaked, one, torch.ones(1), options, 1000)
        assert torch.isfinite(got_kd).all() and torch.isfinite(got_ids).all()
        assert abs(got_kd.item() - kd.item()) <= 1e-5 * max(1.0, abs(kd.item())), name


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.5, 0.9])
def test_adaptive_kl_head_tail_split_with_tied_and_unsorted_bins(support, alpha):
    """The kernel's sort-free split equals the reference's stable sort: bf16-rounded teacher
    log-probs (exact ties), bins in no particular order, α moving the split, both gaps > 0."""
    teacher, at_ids, lse_tempered = _rows(n=16, k=12, seed=11)
    teacher = teacher.to(torch.bfloat16).double()  # exact ties among the small probabilities
    teacher[2:8] = teacher[2:8, torch.randperm(12, generator=torch.Generator().manual_seed(1))]  # unsorted rows
    teacher[9, 3:9] = teacher[9, 3]  # six equal bins
    counted = torch.ones(len(teacher), dtype=torch.bool)
    scale = torch.rand(len(teacher), dtype=torch.float64) + 0.5
    options = DivergenceOptions(divergence="adaptive_kl", support=support, temperature=2.0, adaptive_alpha=alpha)
    _assert_kernel_matches_autograd(teacher, at_ids, lse_tempered, counted, scale, options)


@pytest.mark.parametrize("support, head_mass", [("renormalized", 0.4), ("tail", 0.25)])
def test_adaptive_kl_ties_across_the_alpha_boundary_go_by_position(support, head_mass):
    """Six equal bins of 0.1 with α = 0.25: the reference's stable sort puts the first two
    (by position) in the tail; the kernel must pick the same two."""
    probabilities = torch.tensor([head_mass] + [0.1] * 6, dtype=torch.float64)
    teacher = torch.log(probabilities).repeat(3, 1)
    generator = torch.Generator().manual_seed(5)
    at_ids = 3 * torch.randn(3, 7, generator=generator, dtype=torch.float64)
    lse_tempered = torch.logsumexp(torch.cat([at_ids, 3 * torch.randn(3, 30, generator=generator,
                                                                        dtype=torch.float64)], -1) / 2.0, -1)
    counted = torch.ones(3, dtype=torch.bool)
    scale = torch.ones(3, dtype=torch.float64)
    options = DivergenceOptions(divergence="adaptive_kl", support=support, temperature=2.0, adaptive_alpha=0.25)
    _assert_kernel_matches_autograd(teacher, at_ids, lse_tempered, counted, scale, options)
