"""The student's row pass (ops/row_statistics.py) against float64: the statistics, and the
exponentials ``exp((z - shift) · w)`` it writes in the one-read form, in place over float32 rows
or into a 16-bit buffer, including the rows whose shift must move up (a logit far above every
gathered one, past the first blocks) and a -inf bias at column 0."""
import pytest
import torch

from helpers import HAS_CUDA

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _rows(n=12, width=203, extra=5, k=4, seed=0):
    """float32 logits ``[n, width + extra]`` (extra columns past the vocab hold garbage), bias,
    ids ``[n, k]`` and labels ``[n]``. Rows 1, 4, 7, ... hold a spike 40 above their other
    values at a column outside the ids and the label, after the first blocks."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, width + extra, generator=generator)
    logits[:, width:] = 1e30  # must neither count nor leak into the written row
    bias = torch.randn(width + extra, generator=generator)
    ids = torch.stack([torch.randperm(150, generator=generator)[:k] for _ in range(n)])
    labels = torch.randint(0, 150, (n,), generator=generator)
    logits[1::3, 190] = 60.0  # the interpreter's blocks are 64 columns: block 2 of 3
    logits[2::3, 70] = 50.0
    logits[2::3, 180] = 95.0  # moves twice
    return logits, bias, ids, labels


def _assert_exponentials(exp_out, z, shift, exp_weight, moved):
    """exp_out ``[n, C]`` holds exp((z - shift) · w) on z's columns and 0 past them; ``moved``
    ``[n]``: how far each row's shift moved up from where it started."""
    width = z.shape[1]
    exponent = (z - shift[:, None]) * exp_weight
    expected = torch.exp(exponent)
    written = exp_out.double().cpu()
    # float32: the exponent rounded, times log2(e) rounded, ex2.approx (~2 ulp) on the GPU, and
    # each rescale of an earlier value (its exponent up to |x| + moved · w); fp16 rounds to 11
    # bits and flushes below its subnormals; -inf columns give exp 0
    unit, atol = (2 ** -24, 1e-30) if exp_out.dtype == torch.float32 else (2 ** -11, 1e-7)
    ulps = 8 + 3 * exponent.abs().clamp(max=1e4) + 6 * (moved * exp_weight)[:, None]
    bound = atol + expected * unit * ulps
    assert ((written[:, :width] - expected).abs() <= bound).all()
    assert (written[:, width:] == 0).all()


@pytest.mark.parametrize("exp_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("exp_weight", [1.0, 0.5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_read_writes_the_shifted_exponentials_and_the_statistics(exp_dtype, exp_weight, with_bias):
    from kd_kernels.ops.row_statistics import SHIFT_SLACK, RowStatistics, row_statistics

    logits, bias, ids, labels = _rows()
    n, columns = logits.shape
    width = columns - 5
    z = (logits[:, :width] + (bias[:width] if with_bias else 0)).double()
    buffer = logits.clone().to(DEVICE)
    # fp32: in place over the logits; fp16: over the first half of each float32 row
    exp_out = buffer if exp_dtype == torch.float32 else buffer.view(exp_dtype)[:, :columns]
    out = RowStatistics.empty(n, ids.shape[1], True, True, DEVICE, shift=True)
    row_statistics(buffer, bias[:width].to(DEVICE) if with_bias else None, width, 2.0, out, ids.to(DEVICE),
                   labels.to(DEVICE), exp_out=exp_out, exp_weight=exp_weight)
    shift = out.shift.double().cpu()
    gathered = torch.cat([z.gather(1, ids), z.gather(1, labels[:, None]), z[:, :1]], 1).max(1).values
    assert (shift >= gathered - 1e-5).all() and (shift <= z.max(1).values + 1e-5).all()
    moved = shift > gathered + 1e-3
    assert moved.tolist() == [i % 3 != 0 for i in range(n)]  # exactly the rows with a spike
    assert (((z.max(1).values - shift) * exp_weight) <= SHIFT_SLACK + 1e-4).all()
    _assert_exponentials(exp_out, z, shift, exp_weight, shift - gathered)
    assert torch.allclose(out.lse.double().cpu(), torch.logsumexp(z, 1), rtol=0, atol=1e-5)
    assert torch.allclose(out.lse_tempered.double().cpu(), torch.logsumexp(z / 2.0, 1), rtol=0, atol=1e-5)
    assert torch.equal(out.top1.cpu(), z.argmax(1))
    assert torch.allclose(out.at_ids.double().cpu(), z.gather(1, ids), rtol=0, atol=1e-5)
    assert torch.allclose(out.at_label.double().cpu(), z.gather(1, labels[:, None])[:, 0], rtol=0, atol=1e-5)


def test_a_minus_inf_column_zero_moves_the_shift_at_the_first_finite_value():
    from kd_kernels.ops.launch import one_read_launch
    from kd_kernels.ops.row_statistics import RowStatistics, row_statistics

    logits, bias, _, _ = _rows()
    bias[0] = -float("inf")
    n, width = logits.shape[0], logits.shape[1] - 5
    buffer = logits.clone().to(DEVICE)
    out = RowStatistics.empty(n, 0, False, False, DEVICE, shift=True)
    row_statistics(buffer, bias[:width].to(DEVICE), width, 1.0, out, exp_out=buffer)
    z = (logits[:, :width] + bias[:width]).double()
    assert torch.isfinite(out.shift).all()
    shift = out.shift.double().cpu()
    first_block_max = z[:, :one_read_launch(n)[0]].max(1).values  # where the -inf shift moves first
    _assert_exponentials(buffer, z, shift, 1.0, shift - first_block_max)
    assert buffer[:, 0].eq(0).all()
    assert torch.allclose(out.lse.double().cpu(), torch.logsumexp(z, 1), rtol=0, atol=1e-5)


def test_without_exp_out_the_logits_stay_and_a_shiftless_out_is_refused():
    from kd_kernels.ops.row_statistics import RowStatistics, row_statistics

    logits, _, ids, labels = _rows()
    buffer = logits.clone().to(DEVICE)
    out = RowStatistics.empty(logits.shape[0], ids.shape[1], False, True, DEVICE)
    row_statistics(buffer, None, 203, 1.0, out, ids.to(DEVICE), labels.to(DEVICE))
    assert torch.equal(buffer.cpu(), logits)
    with pytest.raises(ValueError, match="out.shift"):
        row_statistics(buffer, None, 203, 1.0, out, exp_out=buffer)
