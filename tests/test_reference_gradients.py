"""torch.autograd.gradcheck of the reference loss through the lm_head and from logits (float64)."""
import pytest
import torch

import kd_kernels as kd
from kd_kernels import reference
from kd_kernels.options import DIVERGENCES, DivergenceOptions


def _case(seed, n=4, h=3, v=7, k=3):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, generator=generator, requires_grad=True)
    teacher = reference.teacher_topk_from_logits(2 * torch.randn(n, v, dtype=torch.float64, generator=generator), k, 1.5,
                                                 vocab_size=v - 1)
    labels = torch.tensor([0, -100, 5, 2][:n])
    return hidden, weight, bias, teacher, labels


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("divergence", [name for name in DIVERGENCES if name != "adaptive_kl"])
def test_gradcheck_through_lm_head(divergence, support):
    hidden, weight, bias, teacher, labels = _case(DIVERGENCES.index(divergence))
    options = DivergenceOptions(divergence=divergence, support=support, temperature=1.5, ce_weight=0.3, beta=0.3,
                                skew_lambda=0.2, adaptive_alpha=0.3, vocab_size=6)

    def loss(h, w, b):
        return reference.topk_divergence(h, w, teacher, labels, options, bias=b)

    assert torch.autograd.gradcheck(loss, (hidden, weight, bias), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_from_logits_public_api(reduction):
    _, _, _, teacher, labels = _case(11)
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)

    def loss(z):
        out = kd.topk_divergence_from_logits(z, teacher, labels, divergence="jsd", temperature=1.5, ce_weight=0.5,
                                             vocab_size=6, reduction=reduction, backend="torch")
        assert out.dtype == torch.float64  # float64 in, float64 out
        return out

    assert torch.autograd.gradcheck(loss, (logits,), eps=1e-6, atol=1e-6)


def test_renormalized_kd_gradient_reaches_only_the_support():
    _, _, _, teacher, _ = _case(3)
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    reference.topk_divergence_from_logits(logits, teacher, None, DivergenceOptions(temperature=1.5, vocab_size=6)).backward()
    on_support = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, teacher.indices.long(), True)
    assert (logits.grad[~on_support] == 0).all()
    assert (logits.grad[on_support] != 0).any()


def test_padded_columns_get_no_gradient():
    hidden, weight, bias, teacher, labels = _case(5)
    options = DivergenceOptions(support="tail", temperature=1.5, ce_weight=1.0, vocab_size=6)
    reference.topk_divergence(hidden, weight, teacher, labels, options, bias=bias).backward()
    assert (weight.grad[6] == 0).all() and bias.grad[6] == 0
    assert (weight.grad[:6] != 0).any()


@pytest.mark.parametrize("support", ["renormalized", "tail"])
def test_adaptive_kl_gradient_treats_the_gaps_as_constants(support):
    """SPEC: g_head and g_tail are detached, so the gradient is (g_h ∇FKL + g_t ∇RKL) / (g_h + g_t + ε)
    with the gaps frozen; gradcheck's finite differences would move them, so check that form."""
    _, _, _, teacher, _ = _case(7)
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    common = dict(support=support, temperature=1.5, vocab_size=6, reduction="none")
    adaptive = reference.topk_divergence_from_logits(logits, teacher, None, DivergenceOptions(
        divergence="adaptive_kl", adaptive_alpha=0.3, **common))
    forward = reference.topk_divergence_from_logits(logits, teacher, None, DivergenceOptions(**common))
    backward = reference.topk_divergence_from_logits(logits, teacher, None, DivergenceOptions(divergence="reverse_kl",
                                                                                              **common))
    # per row, adaptive = w·FKL + (1 − w')·RKL with constant weights: solve them from two rows of values
    grad_adaptive = torch.autograd.grad(adaptive.sum(), logits)[0]
    for row in range(4):
        g_f = torch.autograd.grad(forward[row], logits, retain_graph=True)[0][row]
        g_r = torch.autograd.grad(backward[row], logits, retain_graph=True)[0][row]
        weights = torch.linalg.lstsq(torch.stack([g_f, g_r], -1), grad_adaptive[row].unsqueeze(-1)).solution.squeeze(-1)
        assert torch.allclose(torch.stack([g_f, g_r], -1) @ weights, grad_adaptive[row], atol=1e-12)
        assert (weights >= -1e-12).all() and weights.sum() <= 1 + 1e-12
        assert (weights[0] * forward[row] + weights[1] * backward[row]).item() == pytest.approx(adaptive[row].item(), rel=1e-9)
