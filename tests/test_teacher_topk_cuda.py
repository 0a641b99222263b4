"""The CUDA top-k kernel (kd_kernels._C, csrc/topk_candidates.cu) against the float64
reference at real shapes: from logits in bf16 / fp16 / fp32, from hidden states, ties (its
exact slow path), rows with -inf, fewer columns than k, unaligned rows; and its input checks.
Runs on the GPU machine when the extension is built (skipped elsewhere)."""
import pytest
import torch

import kd_kernels as kd
from helpers import HAS_CUDA, check_counted_top, check_teacher_topk, counted_keys_case
from kd_kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_ext]


def _extension():
    try:
        from kd_kernels import _C
    except ImportError as error:
        pytest.skip(f"kd_kernels._C is not built: {error}")
    return _C


@pytest.fixture(autouse=True)
def _needs_extension():
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    _extension()


def _llm_like_logits(rows, columns, dtype, seed, scale=3.0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(rows, columns, device="cuda", generator=generator)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [1, 8, 64, 1024])
def test_from_logits_matches_reference(dtype, k):
    logits = _llm_like_logits(512, 151_936, dtype, seed=k)
    top = kd.teacher_topk_from_logits(logits, k=k, temperature=2.0, vocab_size=151_900, backend="cuda")
    expected = reference.teacher_topk_from_logits(logits, k, 2.0, 151_900)
    check_teacher_topk(top, expected, 1e-5, logits, 2.0, 151_900)
    if dtype != torch.float32:  # half-precision values tie exactly: the ids must be the reference's
        assert torch.equal(top.indices.cpu(), expected.indices.cpu())


@pytest.mark.parametrize("k", [8, 512, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_heavy_ties_around_the_kth_value(dtype, k):
    """Rows of few levels (ties of the k-th value) beside ordinary rows: the reference's top-k,
    the lower id first among ties; narrow blocks up to k = 512, wide past it."""
    logits = _llm_like_logits(2000, 151_936, dtype, seed=k)
    logits[-300:] = logits[-300:].round()
    top = kd.teacher_topk_from_logits(logits, k=k, temperature=2.0, backend="cuda")
    expected = reference.teacher_topk_from_logits(logits, k, 2.0, 151_936)
    check_teacher_topk(top, expected, 1e-5, logits, 2.0, 151_936)
    if dtype != torch.float32:
        assert torch.equal(top.indices.cpu(), expected.indices.cpu())


@pytest.mark.parametrize("width", [12_288, 65_536, 65_537, 151_936])
def test_float32_rows_either_side_of_the_narrow_block_width(width):
    """float32 rows take narrow blocks up to 65,536 columns, wide ones past it: the reference's
    top-k either way."""
    logits = _llm_like_logits(1500, width, torch.float32, seed=width)
    top = kd.teacher_topk_from_logits(logits, k=64, temperature=2.0, backend="cuda")
    check_teacher_topk(top, reference.teacher_topk_from_logits(logits, 64, 2.0, width), 1e-5, logits, 2.0, width)


def test_unaligned_rows_and_row_stride():
    wide = _llm_like_logits(300, 50_007, torch.bfloat16, seed=3)
    logits = wide[:, 3:50_003]  # rows start off 16-byte boundaries, odd row stride
    top = kd.teacher_topk_from_logits(logits, k=64, temperature=0.7, backend="cuda")
    expected = reference.teacher_topk_from_logits(logits, 64, 0.7, 50_000)
    assert torch.equal(top.indices.cpu(), expected.indices.cpu())
    check_teacher_topk(top, expected, 1e-5, logits, 0.7, 50_000)


@pytest.mark.parametrize("k", [5, 64, 1024])
def test_ties_take_the_lower_id_through_the_exact_path(k):
    generator = torch.Generator(device="cuda").manual_seed(k)
    logits = torch.randint(0, 4, (64, 151_936), device="cuda", generator=generator).float()  # ~38k ties at the top
    logits[0] = 0.0  # one value everywhere
    logits[1, ::2] = -float("inf")
    top = kd.teacher_topk_from_logits(logits, k=k, temperature=1.0, backend="cuda")
    expected = reference.teacher_topk_from_logits(logits, k, 1.0, 151_936)
    assert torch.equal(top.indices.cpu(), expected.indices.cpu())
    assert top.indices[0].tolist() == list(range(k))
    check_teacher_topk(top, expected, 1e-5, logits, 1.0, 151_936)


def test_fewer_columns_than_k_are_invalid_entries():
    values, columns, lse = _extension().topk_candidates(_llm_like_logits(7, 40, torch.float32, seed=1), 8, 2.0, 5)
    logits = _llm_like_logits(7, 40, torch.float32, seed=1)
    expected_values, expected_columns = torch.sort(logits[:, :5], dim=-1, descending=True, stable=True)
    assert torch.equal(columns[:, :5].long(), expected_columns)
    assert torch.equal(values[:, :5], expected_values / 2.0)
    assert torch.isneginf(values[:, 5:]).all() and (columns[:, 5:] == 0).all()
    assert torch.allclose(lse, torch.logsumexp(logits[:, :5].double() / 2.0, -1).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [8, 1024])
def test_from_hidden_matches_reference(dtype, k):
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(k)
    hidden = (0.2 * torch.randn(1024, 4096, device="cuda", generator=generator)).to(dtype)
    weight = (torch.randn(151_936, 4096, device="cuda", generator=generator) * 0.02).to(dtype)
    bias = (0.5 * torch.randn(151_936, device="cuda", generator=generator)).to(dtype)
    top = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, vocab_size=151_900, bias=bias, backend="cuda",
                          chunk_rows=300)
    exact_logits = reference.lm_head_logits(hidden, weight, bias)
    expected = reference.teacher_topk(hidden, weight, k, 2.0, 151_900, bias)
    check_teacher_topk(top, expected, 1e-4, exact_logits, 2.0, 151_900)
    lean = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, vocab_size=151_900, bias=bias, backend="cuda",
                           lean=True)
    check_teacher_topk(lean, expected, 1e-4, exact_logits, 2.0, 151_900)


def test_auto_takes_cuda_and_reports_it():
    assert kd.available_backends()["cuda"].startswith("available")
    from kd_kernels.backends import CUDA_MAX_TOPK, resolve_backend

    assert _extension().MAX_TOPK == CUDA_MAX_TOPK
    assert resolve_backend("auto", "teacher_topk_from_logits", torch.device("cuda")) == "cuda"
    logits = _llm_like_logits(4, 3000, torch.float32, seed=2)
    top = kd.teacher_topk_from_logits(logits, k=2000)  # above the kernel's limit: auto takes triton
    assert torch.equal(top.indices.cpu(), reference.teacher_topk_from_logits(logits, 2000, 1.0, 3000).indices.cpu())


def test_bad_inputs_raise_clear_errors():
    _C = _extension()
    logits = _llm_like_logits(4, 3000, torch.float32, seed=2)
    with pytest.raises(ValueError, match="k: backend='cuda' selects at most 1024"):
        kd.teacher_topk_from_logits(logits, k=1025, backend="cuda")
    with pytest.raises(ValueError, match="contiguous rows"):
        kd.teacher_topk_from_logits(logits.T.contiguous().T, k=4, backend="cuda")
    # the compiled adapter checks for itself
    with pytest.raises(ValueError, match="logits: expected a CUDA tensor"):
        _C.topk_candidates(logits.cpu(), 4, 1.0, 3000)
    with pytest.raises(TypeError, match="logits: expected dtype"):
        _C.topk_candidates(logits.double(), 4, 1.0, 3000)
    with pytest.raises(ValueError, match="logits: expected 2 dimensions"):
        _C.topk_candidates(logits[0], 4, 1.0, 3000)
    with pytest.raises(ValueError, match="contiguous rows"):
        _C.topk_candidates(logits.T, 4, 1.0, 4)
    with pytest.raises(ValueError, match="k: expected 1 <= k <= 1024, got 0"):
        _C.topk_candidates(logits, 0, 1.0, 3000)
    with pytest.raises(ValueError, match="width: expected 1 <= width <= logits.size"):
        _C.topk_candidates(logits, 4, 1.0, 3001)
    with pytest.raises(ValueError, match="temperature: expected"):
        _C.topk_candidates(logits, 4, 0.0, 3000)


@pytest.mark.parametrize("capacity, k", [(2048, 1024), (300, 300), (4096, 7), (100, 60), (4096, 1024), (4096, 2500)])
@pytest.mark.parametrize("rounded", [True, False])
def test_sort_keys_orders_each_rows_counted_keys(capacity, k, rounded):
    # rounded: the selection keeps more than k keys where the k-th value ties; distinct values run
    # its bisection to a floor exactly k keys reach
    keys, counts, values, columns = counted_keys_case(capacity, k, rounded, rows=64, device="cuda")
    got_values, got_columns = _extension().sort_keys(keys, counts, k)
    check_counted_top(got_values, got_columns, values, columns, counts, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_minus_zero_and_zero_are_one_value_on_the_cuda_kernel(dtype):
    logits = torch.full((2, 4000), -5.0, device="cuda")
    logits[0, [3, 10, 2000, 3000]] = torch.tensor([-0.0, 0.0, -0.0, 0.0], device="cuda")
    logits[1, [1, 2]] = torch.tensor([0.0, -0.0], device="cuda")
    top = kd.teacher_topk_from_logits(logits.to(dtype), k=3, backend="cuda")
    assert top.indices.tolist() == [[3, 10, 2000], [1, 2, 0]]


def test_sort_keys_checks_its_inputs():
    sort_keys = _extension().sort_keys
    keys = torch.zeros(4, 16, dtype=torch.int64, device="cuda")
    counts = torch.zeros(4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="keys: expected a CUDA tensor"):
        sort_keys(keys.cpu(), counts, 4)
    with pytest.raises(TypeError, match="keys: expected dtype int64"):
        sort_keys(keys.int(), counts, 4)
    with pytest.raises(ValueError, match="keys: expected 1 <= keys.size"):
        sort_keys(torch.zeros(2, 5000, dtype=torch.int64, device="cuda"), counts[:2], 4)
    with pytest.raises(ValueError, match="counts: expected a contiguous int32"):
        sort_keys(keys, counts.long(), 4)
    with pytest.raises(ValueError, match="k: expected 1 <= k <= keys.size"):
        sort_keys(keys, counts, 17)
