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
from kd_kernels.teacher_chunked import MAXIMA_MAX_K, teacher_schedule, teacher_topk_appended, teacher_topk_maxima

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
    import kd_kernels.teacher_chunked as chunked

    original = getattr(chunked, function)
    monkeypatch.setattr(chunked, function, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    default = kd.teacher_topk(hidden, weight, k=k, temperature=2.0, backend="triton")
    assert calls == [1]
    cublas = chunked.teacher_topk_cublas(hidden, weight, k, 2.0, 150)
    assert torch.equal(default.indices, cublas.indices)
    assert torch.allclose(default.logprobs, cublas.logprobs, atol=1e-5, rtol=0)


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
