"""The teacher's listed schedule against the float64 reference: the epilogue matmul storing
no logits (ops/lm_head_group_maxima.py, ``logits=None``), the listing of the groups that can
hold the top-k (ops/topk_from_groups.list_groups), their logits computed again
(ops/listed_group_logits.py) and the top-k among them (ops/topk_of_listed.py); overflowing
rows redone exactly (the whole schedule against the reference, on random logits and at the
real shape on a GPU: beside the epilogue schedule's, tests/test_teacher_epilogue.py). Interpreter tiles: 16 rows × 32 columns, groups of 8."""
import pytest
import torch

from helpers import (HAS_CUDA, check_schedule_with_ties_and_fewer_columns_than_k, check_teacher_topk as _check,
                     small_teacher_problem as _problem)
from kd_kernels import reference
from kd_kernels.ops.listed_group_logits import listed_group_logits, plan_pairs
from kd_kernels.ops.lm_head_group_maxima import lm_head_logits_with_summaries, padded_width
from kd_kernels.ops.topk_from_groups import capacity_for, list_groups
from kd_kernels.teacher_chunked import teacher_topk_listed

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def test_summaries_without_logits_equal_those_with_them():
    hidden, weight, bias = _problem(1)
    logits = torch.empty(37, padded_width(200), dtype=torch.float32, device=DEVICE)
    stored = lm_head_logits_with_summaries(hidden, weight, bias, 200, 0.7, logits)
    alone = lm_head_logits_with_summaries(hidden, weight, bias, 200, 0.7, None)
    for name in ("tile_max2", "tile_sum2", "group_max"):
        assert torch.equal(getattr(stored, name), getattr(alone, name)), name


@pytest.mark.parametrize("k, merge", [(3, None), (6, 1), (12, None)])
def test_the_listed_groups_hold_the_top_k_and_their_logits_are_recomputed(k, merge):
    hidden, weight, bias = _problem(k)
    width = 200
    summaries = lm_head_logits_with_summaries(hidden, weight, bias, width, 2.0, None)
    lse, thresholds, group_ids, listed, group_counts, ranks = list_groups(summaries, k, 2.0, merge)
    exact = reference.lm_head_logits(hidden, weight, bias)[:, :width].cpu()
    assert torch.allclose(lse.double().cpu(), torch.logsumexp(exact / 2.0, -1), atol=1e-5, rtol=0)
    groups = summaries.group_max.shape[1]
    columns_per_group = summaries.group_columns
    top_groups = exact.topk(k, dim=-1).indices // columns_per_group
    for row in range(37):
        mine = group_ids[row, :listed[row]].cpu()
        assert k <= listed[row] <= capacity_for(k)
        assert torch.equal(mine, mine.sort().values)  # column order, no repeats
        assert set(top_groups[row].tolist()) <= set(mine.tolist()), row
    # each group's count, and its pairs' ranks 0, 1, ... among them
    pairs = [(int(g), int(r)) for row in range(37) for g, r in zip(group_ids[row, :listed[row]], ranks[row, :listed[row]])]
    assert torch.equal(group_counts.cpu(), torch.bincount(torch.tensor([g for g, _ in pairs]), minlength=groups).int())
    for group in range(groups):
        assert sorted(r for g, r in pairs if g == group) == list(range(int(group_counts[group])))
    plan = plan_pairs(group_ids, listed, group_counts, ranks, budget=int(listed.sum()))
    assert not plan.overflow.any()
    recomputed = listed_group_logits(hidden, weight, bias, width, plan, columns_per_group).cpu()
    padded = torch.full((37, groups * columns_per_group), float("-inf"), dtype=torch.float64)
    padded[:, :width] = exact
    for row in range(37):
        offset = int(plan.offsets[row])
        expected = padded.view(37, groups, columns_per_group)[row, group_ids[row, :listed[row]].long().cpu()]
        assert torch.allclose(recomputed[offset:offset + int(listed[row])].double(), expected, atol=1e-5, rtol=0)


def test_pairs_grouped_by_group_and_past_the_budget_not_computed():
    group_ids = torch.tensor([[0, 2, 0], [1, 2, 3], [4, 0, 0], [1, 3, 4]], dtype=torch.int32, device=DEVICE)
    listed = torch.tensor([2, 3, 1, 4], dtype=torch.int32, device=DEVICE)  # row 3 lists more than its 3 slots
    ranks = torch.tensor([[0, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.int32, device=DEVICE)
    group_counts = torch.tensor([1, 2, 2, 2, 2], dtype=torch.int32, device=DEVICE)
    plan = plan_pairs(group_ids, listed, group_counts, ranks, budget=4)  # row 1's pairs end at 5, row 2's at 6
    assert plan.overflow.tolist() == [False, True, True, True]
    assert plan.offsets.tolist() == [0, 2, 5, 6]
    assert plan.group_start.tolist() == [0, 1, 3, 5, 7, 9]
    # by group: (row 0, slot 0) | (1, 0) (3, 0) | (1, 1) (0, 1) | (1, 2) (3, 1) | (2, 0) (3, 2); overflowing rows' -1
    assert plan.rows[:9].tolist() == [0, 1, 3, 1, 0, 1, 3, 2, 3]
    assert plan.destinations[:9].tolist() == [0, -1, -1, -1, 1, -1, -1, -1, -1]
    assert plan.item_group.tolist()[:5] == [0, 1, 2, 3, 4] and (plan.item_group[5:] == 5).all()


def test_listed_schedule_ties_fewer_columns_than_k_and_overflow():
    check_schedule_with_ties_and_fewer_columns_than_k(teacher_topk_listed)


@pytest.mark.parametrize("schedule, function", [("listed", "teacher_topk_listed"), ("sliced", "teacher_topk_sliced")])
def test_the_public_function_takes_a_schedule_when_forced(schedule, function, monkeypatch):
    """The opt-in schedules (this file's and tests/test_teacher_sliced.py's) through kd.teacher_topk."""
    import kd_kernels as kd
    import kd_kernels.teacher_chunked as chunked

    hidden, weight, _ = _problem(9, rows=18, columns=150, dtype=torch.float16)
    calls = []
    original = getattr(chunked, function)
    monkeypatch.setattr(chunked, function, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    monkeypatch.setenv("KD_KERNELS_TEACHER_SCHEDULE", schedule)
    forced = kd.teacher_topk(hidden, weight, k=8, temperature=2.0, backend="triton")
    assert calls == [1]
    monkeypatch.setenv("KD_KERNELS_TEACHER_SCHEDULE", "cublas")
    cublas = kd.teacher_topk(hidden, weight, k=8, temperature=2.0, backend="triton")
    assert torch.equal(forced.indices, cublas.indices)
    assert torch.allclose(forced.logprobs, cublas.logprobs, atol=1e-5, rtol=0)


def test_a_k_past_the_rank_limit_is_ordered_by_a_sort(monkeypatch):
    from kd_kernels.ops import topk_of_listed as listed_module

    monkeypatch.setattr(listed_module, "RANK_MAX_K", 4)  # k = 12: the candidates' keys sorted outside the kernel
    hidden, weight, bias = _problem(12, dtype=torch.float16)
    top = teacher_topk_listed(hidden, weight, 12, 0.7, 200, bias)
    logits = reference.lm_head_logits(hidden, weight, bias)
    _check(top, reference.teacher_topk(hidden, weight, 12, 0.7, 200, bias), 1e-5, logits, 0.7, 200)
