"""The teacher's maxima schedule against the float64 reference: the epilogue matmul leaving each
group's maximum, its column and second largest (ops/lm_head_group_maxima.py, ``group_top2``),
single-candidate groups' keys straight from them and the groups holding two or more top-k
elements computed again (ops/topk_from_group_top2.py); overflowing rows redone exactly.
Interpreter tiles: 16 rows × 32 columns, groups of 8 (the real shape runs on a GPU in
tests/test_teacher_schedule.py)."""
import functools

import pytest
import torch

from helpers import HAS_CUDA, check_teacher_topk, small_teacher_problem
from kd_kernels import reference
from kd_kernels.topk import TopK
from kd_kernels.ops.lm_head_group_maxima import lm_head_logits_with_summaries, top2_group_column_table
from kd_kernels.ops.topk_from_group_top2 import topk_from_group_top2
from kd_kernels.teacher.maxima import teacher_topk_maxima

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _top2_groups(exact: torch.Tensor, groups: int, columns_per_group: int) -> torch.Tensor:
    """float64 logits ``[R, width]`` -> ``[R, groups, columns_per_group]`` in the top-2 matmul's
    interleaved groups, -inf past the width."""
    padded = torch.full((exact.shape[0], groups * columns_per_group), float("-inf"), dtype=torch.float64)
    padded[:, :exact.shape[1]] = exact
    return padded[:, top2_group_column_table(groups, columns_per_group)]


def test_top2_groups_cover_each_column_once():
    for groups, columns_per_group in ((8, 8), (16, 32), (4, 2)):
        table = top2_group_column_table(groups, columns_per_group)
        assert torch.equal(table.flatten().sort().values, torch.arange(groups * columns_per_group))
    # a group: every 8th pair of columns from 2 · (its place among 4) on, 4 groups a block
    assert top2_group_column_table(8, 8)[5].tolist() == [34, 35, 42, 43, 50, 51, 58, 59]


def test_group_top2_is_each_groups_maximum_column_and_second_largest():
    hidden, weight, bias = small_teacher_problem(2, dtype=torch.float16)
    width = 200
    logits = torch.empty(37, width, dtype=torch.float32, device=DEVICE)  # 800-byte rows: TMA takes them
    stored = lm_head_logits_with_summaries(hidden, weight, bias, width, 0.7, logits)
    summaries = lm_head_logits_with_summaries(hidden, weight, bias, width, 0.7, None, group_top2=True)
    for name in ("tile_max2", "tile_sum2"):  # the top-2 changes neither
        assert torch.equal(getattr(stored, name), getattr(summaries, name)), name
    groups = summaries.group_max.shape[1]
    # against the kernel's own float32 logits: maximum, second and the maximum's column exact
    mine = _top2_groups(logits[:, :width].double().cpu(), groups, summaries.group_columns)
    top2 = mine.topk(2, dim=-1)
    maximum, second = top2.values[..., 0], top2.values[..., 1]
    assert torch.equal(summaries.group_max.double().cpu(), maximum)
    assert torch.equal(summaries.group_second.double().cpu(), second)
    single = maximum > second
    assert single.float().mean() > 0.9
    assert torch.equal(summaries.group_arg.long().cpu()[single], top2.indices[..., 0][single])
    exact = _top2_groups(reference.lm_head_logits(hidden, weight, bias)[:, :width].cpu(), groups,
                         summaries.group_columns)
    finite = maximum.isfinite()
    assert finite.float().mean() > 0.9
    assert torch.allclose(summaries.group_max.double().cpu()[finite], exact.max(dim=-1).values[finite], atol=1e-4)


def test_a_tie_at_a_groups_maximum_makes_its_second_equal_to_it():
    hidden = torch.zeros(16, 16, dtype=torch.float16, device=DEVICE)
    hidden[:, 0] = 1
    weight = torch.zeros(96, 16, dtype=torch.float16, device=DEVICE)
    summaries = lm_head_logits_with_summaries(hidden, weight, None, 96, 1.0, None, group_top2=True)
    table = top2_group_column_table(summaries.group_max.shape[1], summaries.group_columns)
    weight[table[0, [1, 6]], 0] = 2  # group 0 ties at two lanes; group 1 has one maximum, at lane 5
    weight[table[1, 5], 0] = 2
    summaries = lm_head_logits_with_summaries(hidden, weight, None, 96, 1.0, None, group_top2=True)
    assert (summaries.group_max[:, :2] == 2).all() and (summaries.group_second[:, 0] == 2).all()
    assert (summaries.group_arg[:, 1] == 5).all() and (summaries.group_second[:, 1] == 0).all()


@pytest.mark.parametrize("k", [1, 5, 12])
def test_the_selection_from_group_top2_alone(k):
    """The selection kernel on one chunk: its logsumexp, and its top-k from the summaries, the
    single-candidate groups' maxima and the groups computed again."""
    hidden, weight, bias = small_teacher_problem(k, dtype=torch.float16, scale=2.0)
    width, temperature = 200, 2.0
    summaries = lm_head_logits_with_summaries(hidden, weight, bias, width, temperature, None, group_top2=True)
    values, columns, lse, overflow = topk_from_group_top2(hidden, weight, bias, summaries, k, temperature, width)
    exact = reference.lm_head_logits(hidden, weight, bias)[:, :width].cpu()
    assert torch.allclose(lse.double().cpu(), torch.logsumexp(exact / temperature, -1), atol=1e-5, rtol=0)
    assert not overflow.any()
    expected = exact.topk(k, dim=-1)
    assert torch.allclose(values.double().cpu(), expected.values, atol=1e-4, rtol=0)
    exact_at_ours = exact.gather(1, columns.long().cpu())
    assert ((columns.cpu() == expected.indices) | ((exact_at_ours - expected.values).abs() <= 1e-4)).all()


@pytest.mark.parametrize("k, temperature, scale, chunk_rows", [(1, 1.0, 1.0, None), (8, 2.0, 1.0, 16),
                                                               (12, 0.7, 3.0, None), (40, 1.0, 1.0, 16)])
def test_maxima_schedule_matches_the_reference(k, temperature, scale, chunk_rows):
    """scale 3: peaked rows (a few groups hold the whole top-k, many computed again), logits
    near 90 at τ = 0.7, where a float32 ulp is 8e-6 (every schedule is within 1.1e-5); k = 40:
    most groups of 200 columns hold several of the top-k."""
    hidden, weight, bias = small_teacher_problem(k + 100, dtype=torch.float16, scale=scale)
    top = teacher_topk_maxima(hidden, weight, k, temperature, 200, bias, chunk_rows=chunk_rows)
    logits = reference.lm_head_logits(hidden, weight, bias)
    check_teacher_topk(top, reference.teacher_topk(hidden, weight, k, temperature, 200, bias), 1e-5 * scale, logits,
                       temperature, 200)


@functools.lru_cache(maxsize=None)
def _problem_and_default_top_k(k):
    """(hidden, weight, bias, their top-k at the default LISTING_STEPS / KTH_STEPS), computed once a k."""
    hidden, weight, bias = small_teacher_problem(k + 30, rows=37, columns=1000, dtype=torch.float16, scale=2.0)
    return hidden, weight, bias, teacher_topk_maxima(hidden, weight, k, 1.0, 1000, bias)


@pytest.mark.parametrize("k, listing_steps, kth_steps", [(12, 2, 8), (3, 1, 1)])
def test_thresholds_further_below_give_the_same_top_k(k, listing_steps, kth_steps, monkeypatch):
    """LISTING_STEPS, KTH_STEPS: the listing's threshold and T are lower bounds from a few
    value-space bisection steps; fewer steps (lower bounds: more groups listed, more single keys
    and groups computed again) leave the result as it was: the same ids, and the same values but
    where a value now comes from a group computed again (another dot shape: under the
    interpreter the host BLAS may round its last bit differently from the matmul's epilogue)."""
    from kd_kernels.ops import topk_from_group_top2 as top2_module

    hidden, weight, bias, default = _problem_and_default_top_k(k)
    monkeypatch.setattr(top2_module, "LISTING_STEPS", listing_steps)
    monkeypatch.setattr(top2_module, "KTH_STEPS", kth_steps)
    below = teacher_topk_maxima(hidden, weight, k, 1.0, 1000, bias)
    assert torch.equal(below.indices, default.indices)
    logits = default.logprobs + default.lse[:, None]  # τ = 1: the values' own scale, their ulps
    ulps = (below.logprobs - default.logprobs).abs() / (torch.finfo(torch.float32).eps * logits.abs())
    assert ulps.max() <= 2 and (ulps > 0).float().mean() < 0.02
    check_teacher_topk(below, reference.teacher_topk(hidden, weight, k, 1.0, 1000, bias), 2e-5,
                       reference.lm_head_logits(hidden, weight, bias), 1.0, 1000)


@pytest.mark.gpu
@pytest.mark.parametrize("k, lean, backend", [(8, False, "auto"), (64, False, "auto"), (256, False, "auto"),
                                              (1024, False, "auto"), (1024, False, "triton"), (8, True, "auto"),
                                              (1024, True, "auto")])
def test_gpu_teacher_stays_within_64_mib_at_8192_tokens(k, lean, backend):
    """The issue's memory target: beyond the inputs and the top-k it returns, the default
    schedules up to k = 1024 on either backend, and ``lean=True``, hold at most 64 MiB at
    8192 × 4096 × 151,936."""
    import kd_kernels as kd

    generator = torch.Generator(device="cuda").manual_seed(k)
    weight = (torch.randn(151_936, 4096, device="cuda", generator=generator) * 0.02).bfloat16()
    hidden = (torch.randn(8192, 4096, device="cuda", generator=generator) * 0.8).bfloat16()
    kd.teacher_topk(hidden[:256], weight, k=k, temperature=2.0, lean=lean, backend=backend)  # compiled first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    top = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, lean=lean, backend=backend)
    torch.cuda.synchronize()
    outputs = top.logprobs.nbytes + top.indices.nbytes + top.lse.nbytes
    assert torch.cuda.max_memory_allocated() - before - outputs <= 64 << 20
    rows = torch.arange(0, 8192, 1021, device="cuda")
    expected = reference.teacher_topk(hidden[rows], weight, k, 2.0, 151_936)
    check_teacher_topk(TopK(top.logprobs[rows], top.indices[rows], top.lse[rows], 2.0), expected, 1e-4,
                       reference.lm_head_logits(hidden[rows], weight), 2.0, 151_936)
