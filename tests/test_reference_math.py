"""The reference math against cases worked out by hand or with an independent formula.

Independent formulas here are plain-Python loops over bins with the `math` module, or the
closed forms of the KL chain rule; none of them calls kd_kernels' support math.
"""
import math

import pytest
import torch

from kd_kernels import reference
from kd_kernels.options import DivergenceOptions
from kd_kernels.topk import TopK

torch.manual_seed(0)


def _topk(logprobs, indices):
    return TopK(torch.tensor(logprobs, dtype=torch.float64), torch.tensor(indices, dtype=torch.int32))


def _loss(logits, teacher, labels=None, **options):
    logits = torch.tensor(logits, dtype=torch.float64) if not isinstance(logits, torch.Tensor) else logits
    return reference.topk_divergence_from_logits(logits, teacher, labels, DivergenceOptions(**options))


# ---- independent per-bin formulas ------------------------------------------------------

def _kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def _py_divergence(name, p, q, beta=0.5, lam=0.1, alpha=0.5):
    if name == "forward_kl":
        return _kl(p, q)
    if name == "reverse_kl":
        return _kl(q, p)
    if name == "jsd":
        if beta == 0:
            return _kl(p, q)
        if beta == 1:
            return _kl(q, p)
        m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
        return beta * _kl(p, m) + (1 - beta) * _kl(q, m)
    if name == "skewed_forward_kl":
        return _kl(p, [lam * a + (1 - lam) * b for a, b in zip(p, q)])
    if name == "skewed_reverse_kl":
        return _kl(q, [(1 - lam) * a + lam * b for a, b in zip(p, q)])
    if name == "tvd":
        return 0.5 * sum(abs(a - b) for a, b in zip(p, q))
    if name == "adaptive_kl":
        order = sorted(range(len(p)), key=lambda i: p[i])
        cumulative, g_head, g_tail = 0.0, 0.0, 0.0
        for i in order:
            cumulative += p[i]
            if cumulative <= alpha:
                g_tail += abs(p[i] - q[i])
            else:
                g_head += abs(p[i] - q[i])
        return (g_head * _kl(p, q) + g_tail * _kl(q, p)) / (g_head + g_tail + 1e-8)
    raise AssertionError(name)


def _softmax(xs):
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [e / sum(exps) for e in exps]


# ---- teacher top-k ------------------------------------------------------------------------

def test_teacher_topk_hand_case():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.float64)
    top = reference.teacher_topk_from_logits(logits, k=2)
    log_z = math.log(math.e ** 1 + math.e ** 3 + math.e ** 2 + 1)
    assert top.indices.tolist() == [[1, 2]]
    assert top.logprobs[0].tolist() == pytest.approx([3 - log_z, 2 - log_z], abs=1e-12)
    assert top.lse.item() == pytest.approx(log_z, abs=1e-12)


def test_teacher_topk_temperature_vocab_size_and_ties():
    # Column 3 is padding (vocab_size=3) and would win; columns 0 and 2 tie.
    logits = torch.tensor([[4.0, 2.0, 4.0, 50.0]], dtype=torch.float64)
    top = reference.teacher_topk_from_logits(logits, k=3, temperature=2.0, vocab_size=3)
    log_z = math.log(2 * math.e ** 2 + math.e ** 1)
    assert top.indices.tolist() == [[0, 2, 1]]  # lower id first on the tie
    assert top.logprobs[0].tolist() == pytest.approx([2 - log_z, 2 - log_z, 1 - log_z], abs=1e-12)


def test_teacher_topk_k_larger_than_vocab_pads_invalid_entries():
    logits = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    top = reference.teacher_topk_from_logits(logits, k=4)
    assert top.indices.tolist() == [[1, 0, 0, 0]]
    assert top.valid.tolist() == [[True, True, False, False]]
    assert torch.isneginf(top.logprobs[0, 2:]).all()
    assert top.tail_mass.item() == pytest.approx(0.0, abs=1e-12)


def test_teacher_topk_from_hidden_equals_from_logits():
    hidden, weight, bias = torch.randn(5, 4), torch.randn(9, 4), torch.randn(9)
    from_hidden = reference.teacher_topk(hidden, weight, 3, 1.5, bias=bias)
    from_logits = reference.teacher_topk_from_logits(hidden.double() @ weight.double().T + bias.double(), 3, 1.5)
    assert torch.equal(from_hidden.indices, from_logits.indices)
    assert torch.allclose(from_hidden.logprobs, from_logits.logprobs, atol=1e-12)


# ---- divergences: hand values ------------------------------------------------------------

def _two_bin_case():
    # renormalized support over two ids: teacher p = [0.5, 0.5], student q = [0.25, 0.75]
    teacher = _topk([[math.log(0.3), math.log(0.3)]], [[0, 1]])
    student_logits = [[math.log(0.25), math.log(0.75), 5.0]]  # column 2 is outside the support
    return teacher, student_logits


def test_forward_kl_hand_value():
    teacher, logits = _two_bin_case()
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.1438410362
    assert _loss(logits, teacher).item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(0.1438410362, abs=1e-9)


def test_reverse_kl_and_tvd_hand_values():
    teacher, logits = _two_bin_case()
    assert _loss(logits, teacher, divergence="reverse_kl").item() == pytest.approx(
        0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-12)
    assert _loss(logits, teacher, divergence="tvd").item() == pytest.approx(0.25, abs=1e-12)


@pytest.mark.parametrize("name, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("skewed_forward_kl", 0.5),
                                        ("skewed_reverse_kl", 0.5), ("adaptive_kl", 0.5), ("tvd", 0.5),
                                        ("jsd", 0.0), ("jsd", 0.3), ("jsd", 0.5), ("jsd", 1.0)])
def test_every_divergence_against_python_loop(name, beta):
    teacher_p = [0.5, 0.3, 0.15, 0.05]
    student_q = [0.1, 0.6, 0.2, 0.1]
    teacher = _topk([[math.log(x) - 1.0 for x in teacher_p]], [[3, 0, 2, 1]])  # shift: renormalized ignores it
    logits = [[0.0] * 5]
    for q, column in zip(student_q, [3, 0, 2, 1]):
        logits[0][column] = math.log(q) + 2.0
    logits[0][4] = 7.0  # outside the support
    options = dict(divergence=name, beta=beta, skew_lambda=0.2, adaptive_alpha=0.2)
    expected = _py_divergence(name, teacher_p, student_q, beta, 0.2, 0.2)
    assert _loss(logits, teacher, **options).item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_adaptive_kl_hand_case():
    # p ascending: 0.1 (cumsum 0.1 <= 0.15: tail), 0.2 and 0.7 (head); g_tail = 0.1, g_head = 0.1
    p, q = [0.7, 0.2, 0.1], [0.6, 0.2, 0.2]
    teacher = _topk([[math.log(x) for x in p]], [[0, 1, 2]])
    logits = [[math.log(x) for x in q]]
    expected = 0.5 * (_kl(p, q) + _kl(q, p)) * 0.2 / (0.2 + 1e-8)
    assert _loss(logits, teacher, divergence="adaptive_kl", adaptive_alpha=0.15).item() == pytest.approx(expected, rel=1e-9)


def test_jsd_endpoints_are_the_kls_and_half_is_symmetric():
    teacher, logits = _two_bin_case()
    assert _loss(logits, teacher, divergence="jsd", beta=0.0).item() == _loss(logits, teacher).item()
    assert _loss(logits, teacher, divergence="jsd", beta=1.0).item() == _loss(logits, teacher, divergence="reverse_kl").item()
    swapped = _topk([[math.log(0.25), math.log(0.75)]], [[0, 1]])
    swapped_logits = [[math.log(0.5), math.log(0.5), 0.0]]
    assert _loss(logits, teacher, divergence="jsd", beta=0.5).item() == pytest.approx(
        _loss(swapped_logits, swapped, divergence="jsd", beta=0.5).item(), abs=1e-12)


def test_skewed_kls_at_lambda_endpoints():
    teacher, logits = _two_bin_case()
    fkl, rkl = _loss(logits, teacher).item(), _loss(logits, teacher, divergence="reverse_kl").item()
    assert _loss(logits, teacher, divergence="skewed_forward_kl", skew_lambda=0.0).item() == pytest.approx(fkl, abs=1e-12)
    assert _loss(logits, teacher, divergence="skewed_reverse_kl", skew_lambda=0.0).item() == pytest.approx(rkl, abs=1e-12)
    assert _loss(logits, teacher, divergence="skewed_forward_kl", skew_lambda=1.0).item() == pytest.approx(0.0, abs=1e-12)
    assert _loss(logits, teacher, divergence="skewed_reverse_kl", skew_lambda=1.0).item() == pytest.approx(0.0, abs=1e-12)


# ---- support modes -----------------------------------------------------------------------

def test_tail_mode_hand_case():
    # V = 3, k = 1. Teacher p1 = 0.6 (tail 0.4); student q = softmax([ln 2, 0, 0]) = [0.5, .25, .25] (tail 0.5)
    teacher = _topk([[math.log(0.6)]], [[0]])
    logits = [[math.log(2.0), 0.0, 0.0]]
    expected = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5)
    assert _loss(logits, teacher, support="tail").item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd", "tvd"])
def test_tail_mode_with_k_equal_vocab_is_the_full_vocab_divergence(name):
    teacher_logits, student_logits = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    teacher = reference.teacher_topk_from_logits(teacher_logits, k=6)
    loss = reference.topk_divergence_from_logits(student_logits, teacher, None, DivergenceOptions(
        divergence=name, support="tail", reduction="none"))
    for row in range(3):
        p = torch.softmax(teacher_logits[row], -1).tolist()
        q = torch.softmax(student_logits[row], -1).tolist()
        assert loss[row].item() == pytest.approx(_py_divergence(name, p, q), rel=1e-10, abs=1e-12)


def test_tail_and_renormalized_forward_kl_obey_the_chain_rule():
    # KL_tail = P·KL_renorm + P log(P/Q) + (1−P) log((1−P)/(1−Q)), P, Q the masses on the support.
    teacher_logits, student_logits = 3 * torch.randn(4, 20, dtype=torch.float64), 3 * torch.randn(4, 20, dtype=torch.float64)
    teacher = reference.teacher_topk_from_logits(teacher_logits, k=5)
    options = dict(reduction="none")
    tail = reference.topk_divergence_from_logits(student_logits, teacher, None, DivergenceOptions(support="tail", **options))
    renorm = reference.topk_divergence_from_logits(student_logits, teacher, None, DivergenceOptions(**options))
    big_p = teacher.logprobs.exp().sum(-1)
    big_q = torch.softmax(student_logits, -1).gather(-1, teacher.indices.long()).sum(-1)
    expected = big_p * renorm + big_p * torch.log(big_p / big_q) + (1 - big_p) * torch.log((1 - big_p) / (1 - big_q))
    assert torch.allclose(tail, expected, atol=1e-12)


def test_invalid_entries_contribute_exactly_nothing():
    teacher_logits, student_logits = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    top3 = reference.teacher_topk_from_logits(teacher_logits, k=3)
    padded = TopK(torch.cat([top3.logprobs, torch.full((3, 2), -math.inf, dtype=torch.float64)], -1),
                  torch.cat([top3.indices, torch.zeros(3, 2, dtype=torch.int32)], -1))
    # renormalized only: in the tail support a -inf entry also says that the teacher has no other
    # finite column, so the row has no tail bin (tests/test_edge_numerics.py)
    for support in ("renormalized",):
        for name in ("forward_kl", "reverse_kl", "jsd", "adaptive_kl", "tvd", "skewed_forward_kl"):
            options = DivergenceOptions(divergence=name, support=support, reduction="none")
            expected = reference.topk_divergence_from_logits(student_logits, top3, None, options)
            logits = student_logits.clone().requires_grad_()
            got = reference.topk_divergence_from_logits(logits, padded, None, options)
            # the padded bins add exact zeros; only the summation order may differ
            assert torch.allclose(got, expected, rtol=1e-14, atol=0), (name, support)
            got.sum().backward()
            assert torch.isfinite(logits.grad).all()


# ---- KL properties, temperature ------------------------------------------------------------

@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd", "skewed_forward_kl", "skewed_reverse_kl",
                                  "adaptive_kl", "tvd"])
def test_divergences_nonnegative_and_zero_when_student_is_teacher(name, support):
    logits = 4 * torch.randn(6, 30, dtype=torch.float64)
    teacher = reference.teacher_topk_from_logits(logits, k=7, temperature=1.7)
    options = dict(divergence=name, support=support, temperature=1.7, reduction="none")
    same = reference.topk_divergence_from_logits(logits, teacher, None, DivergenceOptions(**options))
    assert same.abs().max().item() < 1e-12
    other = reference.topk_divergence_from_logits(4 * torch.randn(6, 30, dtype=torch.float64), teacher, None,
                                                 DivergenceOptions(**options))
    assert (other > 0).all()


def test_temperature_equals_scaled_logits():
    logits, student = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 12, dtype=torch.float64)
    hot = reference.teacher_topk_from_logits(logits, k=4, temperature=3.0)
    scaled = reference.teacher_topk_from_logits(logits / 3.0, k=4)
    assert torch.equal(hot.indices, scaled.indices) and torch.allclose(hot.logprobs, scaled.logprobs, atol=1e-12)
    for support in ("renormalized", "tail"):
        at_tau = reference.topk_divergence_from_logits(student, hot, None, DivergenceOptions(temperature=3.0, support=support))
        at_one = reference.topk_divergence_from_logits(student / 3.0, scaled, None, DivergenceOptions(support=support))
        assert at_tau.item() == pytest.approx(at_one.item(), abs=1e-12)


def test_high_temperature_flattens_both_sides():
    logits = 5 * torch.randn(3, 10, dtype=torch.float64)
    student = 5 * torch.randn(3, 10, dtype=torch.float64)
    losses = []
    for tau in (1.0, 4.0, 1000.0):
        teacher = reference.teacher_topk_from_logits(logits, k=10, temperature=tau)
        losses.append(reference.topk_divergence_from_logits(student, teacher, None, DivergenceOptions(temperature=tau)).item())
    assert losses[0] > losses[1] > losses[2] and losses[2] < 1e-4


# ---- CE, rows, reductions, metrics -------------------------------------------------------

def test_cross_entropy_hand_value_and_weights():
    teacher = _topk([[0.0]], [[1]])  # one bin: renormalized KD is 0
    logits = [[0.0, math.log(3.0)]]  # softmax = [0.25, 0.75]
    loss = _loss(logits, teacher, torch.tensor([0]), kd_weight=1.0, ce_weight=2.0)
    assert loss.item() == pytest.approx(2 * math.log(4.0), abs=1e-12)


def test_reductions_ignore_index_and_num_tokens():
    teacher_logits = torch.randn(5, 9, dtype=torch.float64)
    student = torch.randn(5, 9, dtype=torch.float64)
    teacher = reference.teacher_topk_from_logits(teacher_logits, k=3)
    labels = torch.tensor([1, -100, 4, -100, 0])
    base = dict(ce_weight=0.5, kd_weight=2.0)
    per_row = reference.topk_divergence_from_logits(student, teacher, labels, DivergenceOptions(reduction="none", **base))
    assert per_row[1].item() == 0 and per_row[3].item() == 0
    ce = -torch.log_softmax(student, -1)[[0, 2, 4], [1, 4, 0]]
    kd_only = reference.topk_divergence_from_logits(student, teacher, labels, DivergenceOptions(reduction="none"))
    assert torch.allclose(per_row[[0, 2, 4]], 2.0 * kd_only[[0, 2, 4]] + 0.5 * ce, atol=1e-12)
    total = reference.topk_divergence_from_logits(student, teacher, labels, DivergenceOptions(reduction="sum", **base))
    mean = reference.topk_divergence_from_logits(student, teacher, labels, DivergenceOptions(**base))
    global_mean = reference.topk_divergence_from_logits(student, teacher, labels, DivergenceOptions(**base), num_tokens=12)
    assert total.item() == pytest.approx(per_row.sum().item(), abs=1e-12)
    assert mean.item() == pytest.approx(total.item() / 3, abs=1e-12)
    assert global_mean.item() == pytest.approx(total.item() / 12, abs=1e-12)
    as_tensor = reference.topk_divergence_from_logits(student, teacher, labels, DivergenceOptions(**base),
                                                      num_tokens=torch.tensor(12))
    assert as_tensor.item() == pytest.approx(global_mean.item(), abs=1e-12)


def test_all_rows_ignored_gives_zero_loss_and_zero_gradients():
    teacher = reference.teacher_topk_from_logits(torch.randn(3, 5, dtype=torch.float64), k=2)
    logits = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    loss = reference.topk_divergence_from_logits(logits, teacher, torch.full((3,), -100),
                                                 DivergenceOptions(ce_weight=1.0))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_metrics_hand_case():
    teacher = _topk([[math.log(0.5), math.log(0.25)], [math.log(0.9), math.log(0.05)]], [[1, 0], [2, 0]])
    logits = torch.log(torch.tensor([[0.2, 0.7, 0.1], [0.3, 0.3, 0.4]], dtype=torch.float64))
    _, metrics = reference.topk_divergence_from_logits(logits, teacher, torch.tensor([0, 2]), DivergenceOptions(ce_weight=1.0),
                                                       return_metrics=True)
    assert metrics["rows"].item() == 2
    assert metrics["teacher_mass_sum"].item() == pytest.approx(0.75 + 0.95, abs=1e-6)
    assert metrics["student_mass_sum"].item() == pytest.approx(0.9 + 0.7, abs=1e-6)
    assert metrics["top1_agreement_sum"].item() == 2.0  # argmax 1 == 1, argmax 2 == 2
    assert metrics["ce_sum"].item() == pytest.approx(-math.log(0.2) - math.log(0.4), abs=1e-6)
