"""The teacher's epilogue schedule against the float64 reference: the matmul that also leaves
each row's tile statistics and group maxima (ops/lm_head_group_maxima.py), the top-k from
those summaries (ops/topk_from_groups.py), the schedule with its exact redo of overflowing
rows, and the choice between schedules. Interpreter tiles: 16 rows × 32 columns, groups of 8."""
import math

import pytest
import torch

import kd_kernels as kd
from helpers import (FLOAT32_INTERPRETED, HAS_CUDA, INTERPRETER_ONLY, check_schedule_with_ties_and_fewer_columns_than_k,
                     check_teacher_topk as _check, small_teacher_problem)
from kd_kernels import reference
from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul, default_config, lm_head_logits_with_summaries, padded_width
from kd_kernels.ops import topk_from_groups as groups_module
from kd_kernels.ops.topk_from_groups import topk_from_group_maxima
from kd_kernels.teacher_chunked import (MAXIMA_MAX_K, teacher_schedule, teacher_topk_appended, teacher_topk_epilogue,
                                        teacher_topk_maxima)

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _summaries(hidden, weight, bias, width, temperature):
    logits = torch.empty(hidden.shape[0], padded_width(width), dtype=torch.float32, device=hidden.device)
    return logits, lm_head_logits_with_summaries(hidden, weight, bias, width, temperature, logits)


@pytest.mark.parametrize("dtype", [FLOAT32_INTERPRETED, torch.float16])
@pytest.mark.parametrize("temperature, with_bias, width", [(1.0, False, 203), (0.5, True, 200), (2.0, True, 77)])
def test_epilogue_logits_statistics_and_group_maxima(dtype, temperature, with_bias, width):
    generator = torch.Generator().manual_seed(width)
    hidden = torch.randn(21, 16, generator=generator).to(DEVICE, dtype)  # 2 row tiles, the second partial
    weight = torch.randn(203, 16, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(203, generator=generator).to(DEVICE, dtype) if with_bias else None
    logits, summaries = _summaries(hidden, weight, bias, width, temperature)
    exact = reference.lm_head_logits(hidden, weight, bias)[:, :width]
    assert torch.allclose(logits[:, :width].double().cpu(), exact.cpu(), atol=1e-5, rtol=1e-6)

    config = default_config()
    tiles = math.ceil(width / config.block_n)
    assert summaries.tile_max2.shape == (21, tiles) and summaries.group_columns == config.group_columns
    lse = torch.logsumexp((summaries.tile_max2 + torch.log2(summaries.tile_sum2)).double() * math.log(2), -1)
    assert torch.allclose(lse.cpu(), torch.logsumexp(exact / temperature, -1).cpu(), atol=1e-5, rtol=0)

    # group maxima: exactly the largest stored logit of each group, -inf past width
    padded = torch.full((21, tiles * config.block_n), float("-inf"), dtype=torch.float32)
    padded[:, :width] = logits[:, :width].cpu()
    expected = padded.view(21, -1, config.group_columns).amax(-1)
    assert torch.equal(summaries.group_max.cpu(), expected)


def test_the_logits_buffer_must_take_tma_stores():
    hidden, weight = torch.zeros(4, 16, dtype=torch.float16), torch.zeros(30, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="logits: the teacher's epilogue matmul moves rows by TMA"):
        lm_head_logits_with_summaries(hidden, weight, None, 30, 1.0, torch.empty(4, 30))  # 120-byte rows
    # float32, or the inputs' own dtype (the appended schedule's sample): nothing else
    with pytest.raises(ValueError, match="logits: expected a float32 buffer .* or one of the inputs' dtype "
                                         "torch.float16 .*, got torch.bfloat16"):
        lm_head_logits_with_summaries(hidden, weight, None, 30, 1.0, torch.empty(4, 32, dtype=torch.bfloat16))


def _topk(logits_rows, k, temperature, width=None):
    """The top-k from summaries of logits given directly: hidden = identity, weight = logits.T."""
    rows, columns = logits_rows.shape
    assert rows <= 16
    width = width or columns
    hidden = torch.eye(rows, 16)
    weight = torch.zeros(columns, 16)
    weight[:, :rows] = logits_rows.T
    logits, summaries = _summaries(hidden.to(DEVICE), weight.to(DEVICE), None, width, temperature)
    return topk_from_group_maxima(logits, summaries, k, temperature, width)


@INTERPRETER_ONLY
def test_the_epilogue_matmul_refuses_float32_natively(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at each construction: the check runs before any launch
    hidden, weight = torch.zeros(4, 16), torch.zeros(30, 16)
    with pytest.raises(ValueError, match="hidden: the epilogue matmul takes bf16 / fp16 on a GPU .* got torch.float32"):
        EpilogueMatmul(hidden, weight, None, 30, 1.0, None)


@INTERPRETER_ONLY
def test_ties_go_to_the_lower_column_across_groups_and_tiles():
    values = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)).round(decimals=1)
    values[0, [150, 3, 77, 40, 9]] = 6.0  # equal maxima in other groups and tiles
    values[1, 8:16] = 5.0  # a whole group of equal values
    values[2, :] = 0.5  # a whole row of ties: more candidates than the 256 slots -> overflow
    # 10 tiles of 4 groups: the threshold from tile maxima (k <= 5), pairs of groups (k = 8), groups (k = 12)
    for k in (1, 4, 8, 12):
        got_values, got_columns, lse, overflow = _topk(values, k, 1.0)
        assert overflow.tolist() == [False, False, True, False, False, False]
        expected, expected_columns = torch.sort(values.double(), dim=-1, descending=True, stable=True)
        keep = torch.tensor([0, 1, 3, 4, 5])
        assert torch.equal(got_columns[keep].cpu().long(), expected_columns[keep, :k])
        assert torch.equal(got_values[keep].cpu(), expected[keep, :k].float())
        assert torch.allclose(lse.double().cpu(), torch.logsumexp(values.double(), -1), atol=1e-5, rtol=0)
    assert _topk(values, 1, 1.0)[1][0].item() == 3


@INTERPRETER_ONLY
def test_fewer_columns_than_k_and_minus_inf_logits():
    values = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    got_values, got_columns, lse, overflow = _topk(values, 12, 0.5, width=7)  # 7 existing columns
    expected, expected_columns = torch.sort(values[:, :7].double(), dim=-1, descending=True, stable=True)
    assert not overflow.any()
    assert torch.equal(got_columns[:, :7].cpu().long(), expected_columns)
    assert torch.equal(got_values[:, :7].cpu(), (expected.float() / 0.5))
    assert torch.isneginf(got_values[:, 7:]).all() and (got_columns[:, 7:] == 0).all()
    assert torch.allclose(lse.double().cpu(), torch.logsumexp(values[:, :7].double() / 0.5, -1), atol=1e-5)


@INTERPRETER_ONLY
@pytest.mark.parametrize("rank_max_k", [1024, 256])
def test_a_large_k_ranked_in_the_kernel_or_sorted_outside(monkeypatch, rank_max_k):
    # k = 300: ranked in the kernel (RANK_MAX_K 1024), or a torch sort of the candidates' keys
    # past RANK_MAX_K; 1200 groups, the threshold from pairs of them (~400 candidates for 600
    # slots: no row overflows)
    monkeypatch.setattr(groups_module, "RANK_MAX_K", rank_max_k)
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 16, generator=generator).to(DEVICE)
    weight = torch.randn(9700, 16, generator=generator).to(DEVICE)
    logits, summaries = _summaries(hidden, weight, None, 9600, 2.0)
    values, columns, lse, overflow = topk_from_group_maxima(logits, summaries, 300, 2.0, 9600)
    assert not overflow.any()
    exact = reference.lm_head_logits(hidden, weight)[:, :9600]
    expected = reference.teacher_topk(hidden, weight, 300, 2.0, 9600)
    assert torch.equal(columns.cpu(), expected.indices.cpu())
    assert torch.allclose((values - lse[:, None]).double().cpu(), expected.logprobs.cpu(), atol=1e-5, rtol=0)
    assert torch.allclose(lse.double().cpu(), torch.logsumexp(exact / 2.0, -1).cpu(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [FLOAT32_INTERPRETED, torch.float16])
@pytest.mark.parametrize("k, temperature, chunk_rows", [(1, 1.0, None), (6, 0.7, 16), (40, 2.0, 20)])
def test_the_epilogue_schedule_matches_the_reference(dtype, k, temperature, chunk_rows):
    generator = torch.Generator().manual_seed(k + 300)
    hidden = torch.randn(37, 16, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(203, 16, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(203, generator=generator).to(DEVICE, dtype)
    top = teacher_topk_epilogue(hidden, weight, k, temperature, 200, bias, chunk_rows)
    logits = reference.lm_head_logits(hidden, weight, bias)
    _check(top, reference.teacher_topk(hidden, weight, k, temperature, 200, bias), 1e-5, logits, temperature, 200)
    assert top.temperature == temperature and (top.indices < 200).all()


def test_overflowing_rows_are_redone_exactly():
    # rows 2, 11, 19 (hidden = e_0) see logits = weight[:, 0]: 0 everywhere but 1 at the last
    # column. Every element reaches the threshold (0), more than the 256 slots, and the slots
    # fill in column order: without the redo those rows would miss column 299
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(20, 16, generator=generator).half()
    hidden[[2, 11, 19]] = 0
    hidden[[2, 11, 19], 0] = 1
    weight = torch.randn(300, 16, generator=generator).half()
    weight[:, 0] = 0
    weight[299, 0] = 1
    top = teacher_topk_epilogue(hidden.to(DEVICE), weight.to(DEVICE), 5, 1.0, 300, chunk_rows=2)  # 2 redo chunks
    assert top.indices[[2, 11, 19]].tolist() == [[299, 0, 1, 2, 3]] * 3
    logits = reference.lm_head_logits(hidden, weight)
    _check(top, reference.teacher_topk(hidden, weight, 5, 1.0, 300), 1e-5, logits, 1.0, 300)


def test_the_schedule_choice_and_its_switch(monkeypatch):
    half = torch.zeros(4, 16, dtype=torch.float16), torch.zeros(50, 16, dtype=torch.float16)
    single = torch.zeros(4, 16), torch.zeros(50, 16)
    odd = torch.zeros(4, 12, dtype=torch.float16), torch.zeros(50, 12, dtype=torch.float16)  # 24-byte rows
    # no chunk of logits stored up to APPENDED_MAX_K, whichever backend ranks
    assert teacher_schedule(*half, 64) == "maxima"  # up to MAXIMA_DEFAULT_K
    assert teacher_schedule(*half, 65) == "appended" and teacher_schedule(*half, 1024) == "appended"
    assert teacher_schedule(*half, 1025) == "cublas" and teacher_schedule(*single, 256) == "cublas"
    assert teacher_schedule(*single, 64) == "cublas" and teacher_schedule(*odd, 64) == "cublas"
    monkeypatch.setenv("KD_KERNELS_TEACHER_SCHEDULE", "cublas")
    assert teacher_schedule(*half, 64) == "cublas"
    # the epilogue-matmul schedules, forced: taken past APPENDED_MAX_K, refused where it does not apply
    for schedule, unfit in (("epilogue", single), ("maxima", odd), ("appended", odd)):
        monkeypatch.setenv("KD_KERNELS_TEACHER_SCHEDULE", schedule)
        assert teacher_schedule(*half, 2048) == schedule
        with pytest.raises(ValueError, match=f"KD_KERNELS_TEACHER_SCHEDULE={schedule}: needs bf16 / fp16"):
            teacher_schedule(*unfit, 64)
    monkeypatch.setenv("KD_KERNELS_TEACHER_SCHEDULE", "fast")
    with pytest.raises(ValueError, match="expected 'epilogue', 'maxima', 'appended' or 'cublas', got 'fast'"):
        teacher_schedule(*half, 64)


@pytest.mark.parametrize("schedule, most_k", [(teacher_topk_maxima, 256), (teacher_topk_appended, 1024)])
def test_the_schedules_without_stored_logits_on_ties_fewer_columns_and_their_k_limit(schedule, most_k):
    check_schedule_with_ties_and_fewer_columns_than_k(schedule)
    hidden, weight, _ = small_teacher_problem(4, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"schedule takes 1 <= k <= {most_k}, got {most_k + 1}"):
        schedule(hidden, weight, most_k + 1, 1.0, 203)


@pytest.mark.parametrize("k, function", [(8, "teacher_topk_maxima"), (70, "teacher_topk_appended")])
def test_the_public_function_takes_the_default_schedule_and_agrees_with_cublas(k, function, monkeypatch):
    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(18, 16, generator=generator).to(DEVICE, torch.float16)
    weight = torch.randn(150, 16, generator=generator).to(DEVICE, torch.float16)
    calls = []
    import kd_kernels.teacher_chunked as chunked

    original = getattr(chunked, function)
    monkeypatch.setattr(chunked, function, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    default = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, backend="triton")
    assert calls == [1]
    monkeypatch.setenv("KD_KERNELS_TEACHER_SCHEDULE", "cublas")
    cublas = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, backend="triton")
    assert calls == [1]
    assert torch.equal(default.indices, cublas.indices)
    assert torch.allclose(default.logprobs, cublas.logprobs, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [teacher_topk_epilogue, teacher_topk_maxima, teacher_topk_appended])
@pytest.mark.parametrize("k", [8, 64, 256, 1024])
def test_gpu_real_shape_epilogue_schedules_with_massive_ties(schedule, k):
    if schedule is teacher_topk_maxima and k > MAXIMA_MAX_K:
        pytest.skip(f"the maxima schedule takes k <= {MAXIMA_MAX_K}")
    generator = torch.Generator(device="cuda").manual_seed(k + 7)
    hidden = (0.2 * torch.randn(2100, 4096, device="cuda", generator=generator)).bfloat16()
    hidden[[0, 1000, 2099]] = 0  # logits = the bias: 0 but for a 1 at the last existing column
    weight = (torch.randn(151_936, 4096, device="cuda", generator=generator) * 0.02).bfloat16()
    bias = torch.zeros(151_936, device="cuda", dtype=torch.bfloat16)
    bias[151_899] = 1
    top = schedule(hidden, weight, k, 2.0, 151_900, bias, chunk_rows=1024)  # 3 chunks, the last 52 rows
    # more candidates than slots (every column reaches the appended schedule's floor): only the redo
    # finds column 151,899
    assert top.indices[[0, 1000, 2099]].tolist() == [[151_899] + list(range(k - 1))] * 3
    exact_logits = reference.lm_head_logits(hidden, weight, bias)
    _check(top, reference.teacher_topk(hidden, weight, k, 2.0, 151_900, bias), 1e-4, exact_logits, 2.0, 151_900)
