"""The teacher's appended schedule against the float64 reference: floors from a sampled column
subset (ops/topk_from_appended.py), the epilogue matmul appending each element at or above its
row's floor (ops/lm_head_group_maxima.py with `Appends`), one sort per row; rows whose floor
kept fewer than k elements or more than the slots redone exactly. Interpreter tiles: 16 rows ×
32 columns, groups of 8 (the real shape runs on a GPU in tests/test_teacher_schedule.py, the 64 MiB
bound through ``lean=True`` in tests/test_teacher_maxima.py)."""
import pytest
import torch

from helpers import FLOAT32_INTERPRETED, HAS_CUDA, check_teacher_topk, decode_raw_keys, small_teacher_problem
from kd_kernels import reference
from kd_kernels.ops import topk_from_appended
from kd_kernels.ops.lm_head_group_maxima import Appends, EpilogueMatmul, lm_head_logits_with_summaries
from kd_kernels.ops.topk_from_appended import appended_plan, sample_floors
from kd_kernels.teacher.appended import teacher_topk_appended
from kd_kernels.teacher.floors import floors_of_rows

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def check_appends_exactly(hidden, weight, bias, width, capacity):
    """The appending matmul keeps exactly each row's elements at or above its floor, floors set
    between each row's 10th and 11th largest (row 5: none reaches it; row 6: the lowest finite
    floor, which every existing column reaches and no -inf past the width), and its statistics
    equal the storing matmul's."""
    rows = hidden.shape[0]
    exact = reference.lm_head_logits(hidden, weight, bias)[:, :width].cpu()
    ordered = exact.sort(dim=1, descending=True).values
    floors = ((ordered[:, 9] + ordered[:, 10]) / 2).float()
    floors[5], floors[6] = float("inf"), torch.finfo(torch.float32).min
    counts = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    keys = torch.zeros(rows, capacity, dtype=torch.int64, device=DEVICE)
    appends = Appends(floors.to(DEVICE), keys, counts)
    summaries = EpilogueMatmul(hidden, weight, bias, width, 0.7, None, appends=appends)(0, width)
    stored = lm_head_logits_with_summaries(hidden, weight, bias, width, 0.7,
                                           torch.empty(rows, width + 8, dtype=torch.float32, device=DEVICE))
    for name in ("tile_max2", "tile_sum2"):  # the statistics do not change
        assert torch.equal(getattr(stored, name), getattr(summaries, name)), name
    expected_counts = (exact >= floors[:, None].double()).sum(1)
    assert expected_counts[6] == width
    assert counts.cpu().tolist() == expected_counts.tolist()
    for row in range(rows):
        if row == 6:  # more than the capacity: the count says so, the slots hold some of them
            assert counts[row] > capacity
            continue
        values, columns = decode_raw_keys(keys[row, :counts[row]].cpu())
        assert sorted(columns.tolist()) == (exact[row] >= floors[row].double()).nonzero().flatten().tolist()
        assert torch.allclose(values.double(), exact[row, columns], atol=1e-4, rtol=0)


def test_the_matmul_appends_exactly_the_elements_at_or_above_each_floor():
    hidden, weight, bias = small_teacher_problem(3, dtype=torch.float16)
    check_appends_exactly(hidden, weight, bias, 200, 64)


@pytest.mark.gpu
def test_the_matmul_appends_exactly_at_the_real_tiles():
    # 128 x 256 tiles, the appends' stores in PTX: rows past a tile, a partial last tile
    generator = torch.Generator(device="cuda").manual_seed(8)
    hidden = (0.3 * torch.randn(300, 4096, device="cuda", generator=generator)).bfloat16()
    weight = (0.02 * torch.randn(20_096, 4096, device="cuda", generator=generator)).bfloat16()
    bias = torch.randn(20_096, device="cuda", generator=generator).bfloat16()
    check_appends_exactly(hidden, weight, bias, 20_000, 256)


def test_sample_floors_are_lower_bounds_within_the_bisection():
    generator = torch.Generator().manual_seed(4)
    sample = torch.randn(6, 300, generator=generator).to(DEVICE)
    floors = sample_floors(sample, 17, torch.empty(6, device=DEVICE)).cpu()
    rank_th = sample.cpu().sort(dim=1, descending=True).values[:, 16]
    spread = sample.cpu().max(1).values - sample.cpu().min(1).values
    assert (floors <= rank_th).all()
    assert (rank_th - floors <= spread / 2 ** topk_from_appended.FLOOR_STEPS).all()
    # a rank past the sample's width: its smallest
    assert torch.equal(sample_floors(sample, 300, torch.empty(6, device=DEVICE)).cpu(), sample.cpu().min(1).values)


def test_the_floors_phase_gives_each_row_its_samples_floor_block_by_block():
    """floors_of_rows: the sample of every stride-th column, block by block of rows within the
    budget (whole quarters of the L2 row group), reduced to the same floors as all rows at once,
    each a lower bound of its row's rank-th largest sampled logit (float64, up to the sample's
    float16 rounding) within the bisection."""
    hidden, weight, bias = small_teacher_problem(5, rows=600, columns=90, dtype=torch.float16)
    plan = appended_plan(90, 3, 4)
    sample_bias = bias[:90:plan.stride].contiguous()
    blocks = []

    def reduce(sample, rows, floors):
        blocks.append((rows.start, rows.stop, sample.shape))
        sample_floors(sample, plan.rank, floors)

    whole = floors_of_rows(hidden, weight, sample_bias, 90, plan, 1.3, 1 << 30, reduce)
    assert blocks == [(0, 600, (600, plan.sample_width))]
    blocks.clear()
    budget = 256 * hidden.element_size() * plan.sample_columns
    by_block = floors_of_rows(hidden, weight, sample_bias, 90, plan, 1.3, budget, reduce)
    assert blocks == [(0, 256, (256, plan.sample_width)), (256, 512, (256, plan.sample_width)),
                      (512, 600, (88, plan.sample_width))]
    assert torch.equal(by_block, whole)
    # the sample holds float16 logits: each within half an ulp (2^-11 relative) of the exact one
    sampled = reference.lm_head_logits(hidden, weight, bias)[:, :90:plan.stride].cpu()
    rank_th = sampled.sort(dim=1, descending=True).values[:, plan.rank - 1]
    spread = sampled.max(1).values - sampled.min(1).values
    assert plan.sample_width == sampled.shape[1]
    rounding = rank_th.abs() * 2.0 ** -10
    assert (whole.cpu().double() <= rank_th + rounding).all()
    assert (rank_th - whole.cpu().double() <= spread / 2 ** topk_from_appended.FLOOR_STEPS + rounding).all()


@pytest.mark.parametrize("dtype", [FLOAT32_INTERPRETED, torch.float16])
@pytest.mark.parametrize("k, temperature, stride, chunk_rows", [(1, 1.0, 3, None), (7, 0.7, 5, 16),
                                                                (40, 2.0, 2, 20)])
def test_appended_schedule_matches_the_reference(dtype, k, temperature, stride, chunk_rows):
    hidden, weight, bias = small_teacher_problem(k + 50, dtype=dtype)
    top = teacher_topk_appended(hidden, weight, k, temperature, 200, bias, chunk_rows, stride=stride)
    logits = reference.lm_head_logits(hidden, weight, bias)
    expected = reference.teacher_topk(hidden, weight, k, temperature, 200, bias)
    check_teacher_topk(top, expected, 1e-5, logits, temperature, 200)
    assert top.temperature == temperature and (top.indices < 200).all()


def test_floors_above_the_kth_largest_are_redone_exactly(monkeypatch):
    # r = 1: the floor is the sample's maximum, above the k-th largest in most rows: those keep
    # fewer than k elements and only the redo gives their top-k
    calls = []
    original = topk_from_appended.rank_appended

    def counted(keys, counts, k, order):
        values, columns, overflow = original(keys, counts, k, order)
        calls.append(int(overflow.sum()))
        return values, columns, overflow
    monkeypatch.setattr(topk_from_appended, "sample_rank", lambda k, stride, width: 1)
    monkeypatch.setattr(topk_from_appended, "rank_appended", counted)
    hidden, weight, bias = small_teacher_problem(9, dtype=torch.float16)
    top = teacher_topk_appended(hidden, weight, 6, 1.0, 200, bias, stride=4)
    assert sum(calls) > 20  # most of the 37 rows were redone
    logits = reference.lm_head_logits(hidden, weight, bias)
    check_teacher_topk(top, reference.teacher_topk(hidden, weight, 6, 1.0, 200, bias), 1e-5, logits, 1.0, 200)


def test_the_appending_matmul_refuses_strided_floors():
    hidden, weight, bias = small_teacher_problem(3, dtype=torch.float16)
    rows = hidden.shape[0]
    strided = torch.zeros(rows, 2, device=DEVICE)[:, 0]
    appends = Appends(strided, torch.zeros(rows, 8, dtype=torch.int64, device=DEVICE),
                      torch.zeros(rows, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"appends: expected contiguous floors \[37\] torch.float32"):
        EpilogueMatmul(hidden, weight, bias, 200, 0.7, None, appends=appends)


@pytest.mark.parametrize("width", [151_936, 128_256, 32_000, 4_096])
@pytest.mark.parametrize("k", [1, 64, 256, 1024])
def test_the_plan_keeps_a_rows_keys_within_its_slots(width, k):
    # the floor's rank inside the sample, and the ~rank · stride elements a floor keeps, plus five
    # of their standard deviations (~stride · sqrt(rank)), within the slots: a row overflows (and
    # is redone) in well under a millionth of rows
    plan = appended_plan(width, k)
    assert plan.rank * plan.stride + 5 * plan.stride * plan.rank ** 0.5 <= plan.capacity
