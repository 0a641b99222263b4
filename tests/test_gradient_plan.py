"""The sparse columns of the student's logit gradient (ops/gradient_plan.py) against a float64
loop over the entries: every column's full gradient (dense part + every sparse term landing on
it), the same value on duplicate columns (invalid entries' id 0, the label among the ids)."""
import pytest
import torch

from helpers import HAS_CUDA

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _expected(teacher, grad_ids, ids, at_ids, lse, lse_t, coef, coef_t, labels, at_label, label_grad, tau):
    """Per row: {column: full gradient} in float64, from the definition."""
    rows = []
    for r in range(ids.shape[0]):
        def dense(z):
            value = coef[r] * torch.exp(z - lse[r])
            return value + (coef_t[r] * torch.exp(z / tau - lse_t[r]) if coef_t is not None else 0.0)
        columns = {}
        for j in range(ids.shape[1]):
            column = int(ids[r, j])
            columns.setdefault(column, dense(at_ids[r, j]))
            if torch.isfinite(teacher[r, j]):
                columns[column] = columns[column] + grad_ids[r, j]
        if labels is not None:
            column = int(labels[r])
            columns.setdefault(column, dense(at_label[r]))
            columns[column] = columns[column] + label_grad[r]
        rows.append(columns)
    return rows


def _plan_inputs(tempered, with_labels):
    """([teacher, grad_ids, ids, at_ids, lse, lse_t, coef, coef_t], [labels, at_label, label_grad])."""
    generator = torch.Generator().manual_seed(3)
    n, k = 16, 6
    teacher = torch.log_softmax(torch.randn(n, 50, generator=generator), -1)[:, :k].clone()
    ids = torch.stack([torch.randperm(49, generator=generator)[:k] + 1 for _ in range(n)])  # 0 only as set below
    teacher[::3, 4:] = -float("inf")  # missing entries point at column 0
    ids[::3, 4:] = 0
    ids[::6, 2] = 0  # a valid id 0 beside them
    labels = torch.randint(0, 50, (n,), generator=generator)
    labels[::2] = ids[::2, 1]  # the label among the ids
    labels[3::6] = 0  # label 0 in a row with missing entries
    student = torch.randn(n, 50, generator=generator)  # the logits gathered at the ids and the label
    at_ids, at_label = student.gather(1, ids), student.gather(1, labels[:, None])[:, 0]
    grad_ids = torch.randn(n, k, generator=generator)
    lse, lse_t, coef, coef_t, label_grad = (torch.randn(n, generator=generator) for _ in range(5))
    lse, lse_t = lse + 3, lse_t + 2
    coef_t = coef_t if tempered else None
    args = [teacher, grad_ids, ids, at_ids, lse, lse_t, coef, coef_t]
    label_args = [labels, at_label, label_grad] if with_labels else [None, None, None]
    return args, label_args


@pytest.mark.parametrize("tempered", [False, True])
@pytest.mark.parametrize("with_labels", [False, True])
def test_full_gradient_on_every_column_and_equal_on_duplicates(tempered, with_labels):
    from kd_kernels.ops.gradient_plan import gradient_plan

    n, k, tau = 16, 6, 2.0
    args, label_args = _plan_inputs(tempered, with_labels)
    columns, values = gradient_plan(*[None if t is None else t.to(DEVICE) for t in args + label_args], tau)
    expected = _expected(*[None if t is None else t.double() if t.is_floating_point() else t
                           for t in args + label_args], tau)
    assert columns.shape == values.shape == (n, k + with_labels)
    for r in range(n):
        assert sorted(set(columns[r].tolist())) == sorted(expected[r])
        for column, value in zip(columns[r].tolist(), values[r].double().cpu()):
            assert value.item() == pytest.approx(expected[r][column].item(), rel=1e-5, abs=1e-6), (r, column)


@pytest.mark.parametrize("exp_weight", [1.0, 0.5])
def test_with_a_shift_the_values_are_divided_by_the_row_factor(exp_weight):
    """The one-read form: factor = coef_w · exp(shift · w − lse_w) (coef and lse at w = 1, the
    tempered pair at w = 1 / τ), values = full values / factor; rows whose factor is 0 are
    flagged to clear and keep their full values (factor 1)."""
    from kd_kernels.ops.gradient_plan import gradient_plan

    tau = 2.0
    args, label_args = _plan_inputs(exp_weight != 1.0, True)
    n = args[0].shape[0]
    lse, lse_t, coef, coef_t = args[4:8]
    if exp_weight != 1.0:
        coef = torch.zeros_like(coef)  # w = 1 / τ: the dense part is the tempered term's alone
        args[6] = coef
    zeroed = torch.arange(n) % 5 == 2
    (coef_t if exp_weight != 1.0 else coef)[zeroed] = 0.0  # nothing dense: cleared rows
    shift = torch.randn(n, generator=torch.Generator().manual_seed(4)) + 1.0
    device_args = [None if t is None else t.to(DEVICE) for t in args + label_args]
    columns, values = gradient_plan(*device_args, tau)
    shifted_columns, shifted, row_scale, clear = gradient_plan(*device_args, tau, shift.to(DEVICE), exp_weight)
    coef_w, lse_w = (coef, lse) if exp_weight == 1.0 else (coef_t, lse_t)
    factor = coef_w.double() * torch.exp(shift.double() * exp_weight - lse_w.double())
    assert torch.equal(clear.cpu(), zeroed.to(torch.int8))
    assert torch.allclose(row_scale.double().cpu(), torch.where(zeroed, 1.0, factor), rtol=1e-5, atol=0)
    assert torch.equal(shifted_columns, columns)
    assert torch.allclose(shifted.double().cpu() * row_scale.double().cpu()[:, None], values.double().cpu(),
                          rtol=1e-5, atol=1e-7)


def test_a_shift_with_two_dense_terms_is_refused():
    from kd_kernels.ops.gradient_plan import gradient_plan

    args, label_args = _plan_inputs(True, False)
    with pytest.raises(ValueError, match="one dense term"):
        gradient_plan(*args, *label_args, 2.0, torch.zeros(args[0].shape[0]), 1.0)
