"""``out[r, :] = x[r, :] · scale[r]`` (ops/scale_rows.py): float32 arithmetic, one rounding to
out's dtype, in place or into another buffer, rows with a stride past their width."""
import pytest
import torch

from helpers import HAS_CUDA

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("in_place", [False, True])
def test_each_row_times_its_factor_rounded_once(dtype, in_place):
    from kd_kernels.ops.scale_rows import scale_rows

    generator = torch.Generator().manual_seed(0)
    storage = torch.randn(7, 3000, generator=generator).to(DEVICE, dtype)
    x = storage[:, :2500]  # a row stride past the width, and more columns than one program's block
    scale = torch.exp(4 * torch.randn(7, generator=generator)).to(DEVICE)
    scale[3] = 0.0
    expected = (x.float() * scale[:, None]).to(dtype)  # the float32 product, rounded once to dtype
    exact = x.double() * scale.double()[:, None]
    untouched = storage[:, 2500:].clone()
    out = x if in_place else torch.empty_like(x)
    assert scale_rows(x, scale, out) is out
    assert torch.equal(out.cpu(), expected.cpu())
    half = dtype == torch.float16  # its subnormals start at 6e-5: an absolute floor there
    assert torch.allclose(out.double().cpu(), exact.cpu(), rtol=2.0 ** -10 if half else 2.0 ** -23,
                          atol=2.0 ** -24 if half else 0.0)
    assert torch.equal(storage[:, 2500:], untouched)
