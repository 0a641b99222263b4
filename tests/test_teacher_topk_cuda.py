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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pass_one_through_registers_or_the_cp_async_pipeline_gives_the_same_bits(dtype, monkeypatch):
    """KD_KERNELS_TOPK_PIPELINE only changes how 16-bit rows reach pass 1 (odd width and an
    unaligned start exercise the head and the tail)."""
    logits = _llm_like_logits(700, 150_003, dtype, seed=5)[:, 1:]
    results = []
    for choice in ("0", "1"):
        monkeypatch.setenv("KD_KERNELS_TOPK_PIPELINE", choice)
        results.append(kd.teacher_topk_from_logits(logits, k=64, temperature=0.5, backend="cuda"))
    assert torch.equal(results[0].indices, results[1].indices)
    assert torch.equal(results[0].logprobs, results[1].logprobs) and torch.equal(results[0].lse, results[1].lse)


@pytest.mark.parametrize("switch", ["KD_KERNELS_TOPK_FILTER", "KD_KERNELS_TOPK_NARROW"])
@pytest.mark.parametrize("k", [8, 64, 512, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speed_switches_give_the_same_bits(dtype, k, switch, monkeypatch):
    """The kernel's speed switches (candidates below T dropped before the sort; narrow blocks,
    four per SM, for k <= 512) give the reference's top-k either way, ties of the k-th value
    included (rows of few levels): the same ids, and the same bits where the block shape is
    the same (narrow blocks sum the logsumexp in another order: float32 rounding apart)."""
    logits = _llm_like_logits(2000, 151_936, dtype, seed=k)
    logits[-300:] = logits[-300:].round()  # heavy ties around the k-th value
    results = []
    for choice in ("0", "1"):
        monkeypatch.setenv(switch, choice)
        results.append(kd.teacher_topk_from_logits(logits, k=k, temperature=2.0, backend="cuda"))
    assert torch.equal(results[0].indices, results[1].indices)
    if switch == "KD_KERNELS_TOPK_NARROW" and k <= 512:  # past 512 both launches are wide: same bits
        assert torch.allclose(results[0].lse, results[1].lse, rtol=1e-6, atol=0)
        assert torch.allclose(results[0].logprobs, results[1].logprobs, rtol=0, atol=1e-5)
    else:
        assert torch.equal(results[0].logprobs, results[1].logprobs) and torch.equal(results[0].lse, results[1].lse)
    expected = reference.teacher_topk_from_logits(logits, k, 2.0, 151_936)
    check_teacher_topk(results[1], expected, 1e-5, logits, 2.0, 151_936)
    if dtype != torch.float32:
        assert torch.equal(results[1].indices.cpu(), expected.indices.cpu())


@pytest.mark.parametrize("width, narrow_by_default", [(12_288, "1"), (65_536, "1"), (65_537, "0"), (151_936, "0")])
def test_float32_rows_take_narrow_blocks_up_to_65536_columns(width, narrow_by_default, monkeypatch):
    """The default block shape of float32 rows follows their length (short rows, such as the
    lean schedule's tiles, are faster with narrow blocks): the default gives the bits of that
    shape forced, and the reference's top-k."""
    logits = _llm_like_logits(1500, width, torch.float32, seed=width)
    monkeypatch.delenv("KD_KERNELS_TOPK_NARROW", raising=False)
    default = kd.teacher_topk_from_logits(logits, k=64, temperature=2.0, backend="cuda")
    monkeypatch.setenv("KD_KERNELS_TOPK_NARROW", narrow_by_default)
    forced = kd.teacher_topk_from_logits(logits, k=64, temperature=2.0, backend="cuda")
    assert torch.equal(default.indices, forced.indices)
    assert torch.equal(default.logprobs, forced.logprobs) and torch.equal(default.lse, forced.lse)
    monkeypatch.setenv("KD_KERNELS_TOPK_NARROW", "0" if narrow_by_default == "1" else "1")
    other = kd.teacher_topk_from_logits(logits, k=64, temperature=2.0, backend="cuda")
    assert not torch.equal(other.lse, default.lse)  # the shapes sum in other orders: the check above tells them apart
    check_teacher_topk(default, reference.teacher_topk_from_logits(logits, 64, 2.0, width), 1e-5, logits, 2.0, width)


def test_the_pass_one_margin_changes_no_bit(monkeypatch):
    """KD_KERNELS_TOPK_MARGIN only decides how often pass 2 runs (0: nearly always)."""
    logits = _llm_like_logits(1500, 151_936, torch.bfloat16, seed=9)
    results = []
    for margin in ("0", "2", "8"):
        monkeypatch.setenv("KD_KERNELS_TOPK_MARGIN", margin)
        results.append(kd.teacher_topk_from_logits(logits, k=64, temperature=2.0, backend="cuda"))
    for other in results[1:]:
        assert torch.equal(results[0].indices, other.indices) and torch.equal(results[0].logprobs, other.logprobs)
    check_teacher_topk(results[0], reference.teacher_topk_from_logits(logits, 64, 2.0, 151_936), 1e-5, logits, 2.0,
                       151_936)


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


# (KD_KERNELS_SORT_REGISTERS, KD_KERNELS_SORT_SELECT): csrc/sort_keys.cu reads them at each launch
SORTS = {"registers, the keys reaching the k-th value first": ("1", "1"), "registers, every key": ("1", "0"),
         "shared memory": ("0", "1")}


@pytest.mark.parametrize("sort", SORTS)
@pytest.mark.parametrize("capacity, k", [(2048, 1024), (300, 300), (4096, 7), (100, 60), (4096, 1024), (4096, 2500)])
@pytest.mark.parametrize("rounded", [True, False])
@pytest.mark.parametrize("raw", [False, True])
def test_sort_keys_orders_each_rows_counted_keys(capacity, k, sort, rounded, raw, monkeypatch):
    monkeypatch.setenv("KD_KERNELS_SORT_REGISTERS", SORTS[sort][0])
    monkeypatch.setenv("KD_KERNELS_SORT_SELECT", SORTS[sort][1])
    # rounded: the selection keeps more than k keys where the k-th value ties; distinct values run
    # its bisection to a floor exactly k keys reach
    keys, counts, values, columns = counted_keys_case(capacity, k, rounded, raw, rows=64, device="cuda")
    got_values, got_columns = _extension().sort_keys(keys, counts, k, raw)
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
