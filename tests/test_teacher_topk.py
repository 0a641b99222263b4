"""Teacher top-k on the Triton backend against the float64 reference: same ids (lower id
first on ties), log-probs within float32 rounding, invalid-free rows, temperature, vocab_size."""
import pytest
import torch

import kd_kernels as kd
from helpers import HAS_CUDA, check_teacher_topk as _check
from kd_kernels import reference

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.float16, 1e-4)])
@pytest.mark.parametrize("k, temperature, chunk_rows", [(1, 1.0, None), (7, 0.7, 10), (64, 2.0, 16)])
def test_teacher_topk_from_hidden(k, temperature, chunk_rows, dtype, atol):
    generator = torch.Generator().manual_seed(k)
    hidden = torch.randn(37, 16, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(203, 16, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(203, generator=generator).to(DEVICE, dtype)
    top = kd.teacher_topk(hidden, weight, k=k, temperature=temperature, vocab_size=200, bias=bias, backend="triton",
                          chunk_rows=chunk_rows)
    logits = reference.lm_head_logits(hidden, weight, bias)
    _check(top, reference.teacher_topk(hidden, weight, k, temperature, 200, bias), atol, logits, temperature, 200)
    assert top.temperature == temperature and (top.indices < 200).all()


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.float16, 1e-4)])
@pytest.mark.parametrize("k, temperature, tile", [(1, 1.0, (37, 64)), (7, 0.7, (10, 50)), (64, 2.0, (16, 32))])
def test_teacher_topk_lean_merges_tiles(k, temperature, tile, dtype, atol):
    from kd_kernels.teacher.tiled import teacher_topk_tiled

    generator = torch.Generator().manual_seed(k + 100)
    hidden = torch.randn(37, 16, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(203, 16, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(203, generator=generator).to(DEVICE, dtype)
    top = teacher_topk_tiled(hidden, weight, k, temperature, 200, bias, tile=tile)
    logits = reference.lm_head_logits(hidden, weight, bias)
    _check(top, reference.teacher_topk(hidden, weight, k, temperature, 200, bias), atol, logits, temperature, 200)


def test_lean_tile_bounds_the_memory_whatever_n_and_v():
    from kd_kernels.teacher.tiled import LEAN_SLICE_BYTES, lean_tile

    for num_rows, k in ((8192, 64), (16384, 1024), (100, 8)):
        rows, columns = lean_tile(num_rows, k)
        assert 1 <= rows <= min(num_rows, 1024) and 4 * rows * columns <= LEAN_SLICE_BYTES
        assert 40 * rows * k <= 2 * (16 << 20) or rows == 128


def test_teacher_topk_lean_ties_across_tiles_go_to_the_lower_id():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 16, generator=generator).to(DEVICE)
    weight = torch.randn(300, 16, generator=generator)
    weight[[5, 150, 290]] = 3 * weight[7]  # equal logits in three slices
    weight = weight.to(DEVICE)
    from kd_kernels.teacher.tiled import teacher_topk_tiled

    top = teacher_topk_tiled(hidden, weight, 4, 1.0, 300, tile=(4, 100))  # 3 row chunks × 3 slices
    expected = reference.teacher_topk(hidden, weight, 4, 1.0, 300)
    assert torch.equal(top.indices.cpu(), expected.indices.cpu())
    public = kd.teacher_topk(hidden, weight, k=4, temperature=1.0, backend="triton", lean=True)
    assert torch.equal(public.indices.cpu(), expected.indices.cpu())
    rows = (top.indices == 5).any(-1).nonzero().flatten().tolist()
    assert rows, "the tied columns should lead some row"
    for row in rows:
        order = [i for i in top.indices[row].tolist() if i in (5, 150, 290)]
        assert order == sorted(order)


def test_teacher_topk_from_logits_ties_go_to_the_lower_id():
    logits = torch.randn(9, 130, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[0, [5, 90, 17]] = 9.0
    top = kd.teacher_topk_from_logits(logits, k=5, temperature=2.0, vocab_size=128, backend="triton")
    assert top.indices[0, :3].tolist() == [5, 17, 90]
    _check(top, reference.teacher_topk_from_logits(logits, 5, 2.0, 128), 1e-5, logits, 2.0, 128)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_minus_zero_and_zero_are_one_value_whose_ties_go_to_the_lower_id(backend):
    logits = torch.full((2, 40), -5.0)
    logits[0, [3, 10, 20, 30]] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    logits[1, [1, 2]] = torch.tensor([0.0, -0.0])
    top = kd.teacher_topk_from_logits(logits.to(DEVICE), k=3, backend=backend)
    assert top.indices.tolist() == [[3, 10, 20], [1, 2, 0]]


@pytest.mark.gpu
@pytest.mark.parametrize("k", [8, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_shape(k, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(k)
    hidden = (0.2 * torch.randn(1024, 4096, device="cuda", generator=generator)).to(dtype)
    weight = (torch.randn(151_936, 4096, device="cuda", generator=generator) * 0.02).to(dtype)
    top = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, vocab_size=151_900, backend="triton")
    exact_logits = reference.lm_head_logits(hidden, weight)
    _check(top, reference.teacher_topk(hidden, weight, k, 2.0, 151_900), 1e-4, exact_logits, 2.0, 151_900)
    del exact_logits
    logits = hidden @ weight.T
    from_logits = kd.teacher_topk_from_logits(logits, k=k, temperature=2.0, vocab_size=151_900, backend="triton")
    _check(from_logits, reference.teacher_topk_from_logits(logits, k, 2.0, 151_900), 1e-4, logits, 2.0, 151_900)


def test_triton_threshold_topk_heavy_ties_narrow_rows_and_minus_inf():
    from kd_kernels.ops.topk_threshold import threshold_topk

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    logits[0] = 1.5  # 300 equal values: more than the 256 candidate slots (the exact full-row path)
    logits[1, ::3] = -float("inf")
    logits[2, 40:140] = 4.0  # 100 ties at the top
    logits = logits.to(DEVICE)
    for k, width in ((64, 300), (8, 5)):
        values, columns, lse = threshold_topk(logits, k, 0.5, width)
        expected, expected_columns = torch.sort(logits[:, :width].float(), dim=-1, descending=True, stable=True)
        kept = min(k, width)
        assert torch.equal(columns[:, :kept].cpu(), expected_columns[:, :kept].cpu())
        assert torch.equal(values[:, :kept].cpu(), (expected[:, :kept] / 0.5).cpu())
        assert torch.isneginf(values[:, kept:]).all() and (columns[:, kept:] == 0).all()
        expected_lse = torch.logsumexp(logits[:, :width].double() / 0.5, -1)
        assert torch.allclose(lse.double().cpu(), expected_lse.cpu(), atol=1e-5)
