"""The teacher's schedules from hidden states: the choice between them, and the two that store
no logits (maxima, appended) on ties, fewer columns than k, their k limits and at the real
shape with massive ties; the public function against cuBLAS logits and the full-row selection.
Interpreter tiles: 16 rows × 32 columns, groups of 8."""
import pytest
import torch

import kd_kernels as kd
from helpers import (HAS_CUDA, check_schedule_with_ties_and_fewer_columns_than_k, check_teacher_topk as _check,
                     small_teacher_problem)
from kd_kernels import reference
from kd_kernels.teacher import schedule as schedule_module
from kd_kernels.ops.topk_from_appended import appended_plan
from kd_kernels.teacher.appended import teacher_topk_appended
from kd_kernels.teacher.chunks import MATMUL_ROW_GROUP, appended_chunk_rows
from kd_kernels.teacher.logits_rows import teacher_topk_cublas
from kd_kernels.teacher.maxima import MAXIMA_MAX_K, teacher_topk_maxima
from kd_kernels.teacher.schedule import teacher_schedule

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def test_the_schedule_choice():
    half = torch.zeros(4, 16, dtype=torch.float16), torch.zeros(50, 16, dtype=torch.float16)
    single = torch.zeros(4, 16), torch.zeros(50, 16)
    odd = torch.zeros(4, 12, dtype=torch.float16), torch.zeros(50, 12, dtype=torch.float16)  # 24-byte rows
    # no chunk of logits stored up to APPENDED_MAX_K where the epilogue matmul takes the inputs
    assert teacher_schedule(*half, 1) == "maxima" and teacher_schedule(*half, MAXIMA_MAX_K) == "maxima"
    assert teacher_schedule(*half, MAXIMA_MAX_K + 1) == "appended" and teacher_schedule(*half, 1024) == "appended"
    assert teacher_schedule(*half, 1025) == "cublas" and teacher_schedule(*single, 256) == "cublas"
    assert teacher_schedule(*single, 64) == "cublas" and teacher_schedule(*odd, 64) == "cublas"


def test_appended_chunks_are_whole_quarter_groups_spread_evenly_within_the_budget():
    plan = appended_plan(151_936, 17)  # 8 · 2048 key bytes + 8 · 594 tile statistics a row (block_n 256)
    per_row = 8 * plan.capacity + 8 * 594
    quarter = MATMUL_ROW_GROUP // 4
    for num_rows in (100, 1000, 4096, 5000, 8192, 12_345, 16_384):
        for budget in (56 << 20, 112 << 20):
            rows = appended_chunk_rows(num_rows, 151_936, plan, 256, 0, budget)
            fewest = -(-num_rows // max(quarter, budget // per_row // quarter * quarter))
            assert rows == num_rows or (rows % quarter == 0 and rows * per_row <= budget)
            assert -(-num_rows // rows) == (1 if rows == num_rows else fewest)  # no more chunks than needed
    assert appended_chunk_rows(8192, 151_936, plan, 256, 0, 112 << 20) == 4096  # not 5120 and 3072


@pytest.mark.parametrize("schedule, most_k", [(teacher_topk_maxima, MAXIMA_MAX_K), (teacher_topk_appended, 1024)])
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
    original = getattr(schedule_module, function)
    monkeypatch.setattr(schedule_module, function, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    default = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, backend="triton")
    assert calls == [1]
    cublas = teacher_topk_cublas(hidden, weight, k, 2.0, 150)
    assert torch.equal(default.indices, cublas.indices)
    assert torch.allclose(default.logprobs, cublas.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype, k, expected", [(torch.float16, 5, "maxima"), (torch.float16, 64, "maxima"),
                                                (torch.float16, 65, "appended"), (torch.float32, 5, "tiled")])
def test_lean_takes_the_maxima_then_the_appended_schedule_for_16_bit_inputs(monkeypatch, dtype, k, expected):
    """``lean=True`` without the extension: 16-bit inputs the epilogue matmul takes go to the
    maxima schedule up to k = 64, to the appended one past it, the rest to the tiled one; all
    match the reference."""
    taken = []
    for name in ("teacher_topk_maxima", "teacher_topk_appended", "teacher_topk_tiled"):
        schedule = getattr(schedule_module, name)
        monkeypatch.setattr(schedule_module, name, lambda *args, _schedule=schedule, _name=name, **kwargs: (
            taken.append(_name.split("_")[-1]), _schedule(*args, **kwargs))[1])
    hidden, weight, bias = small_teacher_problem(k, rows=6, columns=300, dtype=dtype)
    top = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, vocab_size=300, bias=bias, backend="triton",
                          lean=True)
    assert taken == [expected]
    expected_top = reference.teacher_topk(hidden, weight, k, 2.0, 300, bias)
    _check(top, expected_top, 1e-4, reference.lm_head_logits(hidden, weight, bias), 2.0, 300)


@pytest.mark.parametrize("k, expected", [(64, "maxima"), (65, "appended"), (1024, "appended"), (1025, "tiled")])
@pytest.mark.parametrize("select", ["cuda", "triton"])
def test_lean_takes_the_appended_schedule_past_k_64_on_either_backend(monkeypatch, k, expected, select):
    """The choice alone, whichever backend ranks."""
    taken = []
    for name in ("teacher_topk_maxima", "teacher_topk_appended", "teacher_topk_tiled"):
        monkeypatch.setattr(schedule_module, name, lambda *args, _name=name, **kwargs: taken.append(_name))
    hidden, weight, _ = small_teacher_problem(1, rows=4, columns=2000, dtype=torch.float16)
    schedule_module.teacher_topk_lean(hidden, weight, k, 2.0, 2000, select=select)
    assert taken == [f"teacher_topk_{expected}"]


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [teacher_topk_maxima, teacher_topk_appended])
@pytest.mark.parametrize("k", [8, 64, 256, 1024])
def test_gpu_real_shape_schedules_without_stored_logits_with_massive_ties(schedule, k):
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
