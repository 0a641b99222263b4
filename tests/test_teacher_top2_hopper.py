"""The Hopper ping-pong group top-2 matmul (ops/lm_head_group_top2_hopper.py) against the Triton
epilogue matmul it replaces on sm_90 (the groups bit for bit) and the float64 reference (group
maxima, the row logsumexp from its 128-column tile statistics, the maxima schedule's top-k);
the choice between the two kernels."""
import pytest
import torch

from helpers import HAS_CUDA, check_teacher_topk
from kd_kernels import reference
from kd_kernels.ops import lm_head_group_top2_hopper as hopper
from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul, top2_group_column_table
from kd_kernels.teacher_chunked import teacher_topk_maxima

SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the ping-pong kernel runs on sm_90 (Hopper) only")


def test_an_unknown_choice_is_an_error(monkeypatch):
    monkeypatch.setenv("KD_KERNELS_TOP2_MATMUL", "fastest")
    tensor = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"KD_KERNELS_TOP2_MATMUL: expected one of \('triton', 'pingpong'\)"):
        hopper.top2_matmul_choice(tensor, tensor)


def test_the_triton_kernel_is_the_default_and_the_ping_pong_refuses_what_it_cannot_run(monkeypatch):
    tensor = torch.zeros(4, 8, dtype=torch.bfloat16)  # on the CPU: no ping-pong kernel
    monkeypatch.delenv("KD_KERNELS_TOP2_MATMUL", raising=False)
    assert hopper.top2_matmul_choice(tensor, tensor) == "triton"
    monkeypatch.setenv("KD_KERNELS_TOP2_MATMUL", "pingpong")
    with pytest.raises(ValueError, match="KD_KERNELS_TOP2_MATMUL=pingpong: needs CUDA tensors"):
        hopper.top2_matmul_choice(tensor, tensor)
    with pytest.raises(ValueError, match="hidden, weight: the Hopper group top-2 matmul needs CUDA tensors"):
        hopper.group_top2_summaries(tensor, tensor, None, 4, 1.0)
    with pytest.raises(ValueError, match="KD_KERNELS_TOP2_MATMUL=pingpong: needs CUDA tensors"):
        teacher_topk_maxima(tensor, tensor, 1, 1.0, 4)  # the schedule asks before its first chunk


@pytest.mark.gpu
@pytest.mark.skipif(SM90 or not HAS_CUDA, reason="checks the refusal on a GPU other than sm_90")
def test_other_gpus_are_refused_by_name():
    tensor = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        hopper.group_top2_summaries(tensor, tensor, None, 4, 1.0)


def _problem(rows, hidden_size, weight_rows, dtype, with_bias, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(rows, hidden_size, device="cuda", generator=generator) * 0.6).to(dtype)
    weight = (torch.randn(weight_rows, hidden_size, device="cuda", generator=generator) * 0.1).to(dtype)
    bias = (torch.randn(weight_rows, device="cuda", generator=generator) * 0.5).to(dtype) if with_bias else None
    return hidden, weight, bias


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype, rows, hidden_size, width, column_start, with_bias", [
    (torch.bfloat16, 1000, 512, 50_017, 0, True),  # a partial row tile, a ragged last column tile
    (torch.float16, 300, 256, 4099, 2048, False),  # a vocab slice from column 2048 on
    (torch.bfloat16, 2048, 4096, 151_936, 0, False),  # the Qwen-like width and hidden size
])
def test_groups_equal_the_triton_kernels_and_the_statistics_the_reference(dtype, rows, hidden_size, width,
                                                                          column_start, with_bias):
    hidden, weight, bias = _problem(rows, hidden_size, column_start + width + 3, dtype, with_bias)
    temperature = 0.7
    ours = hopper.group_top2_summaries(hidden, weight, bias, width, temperature, column_start)
    theirs = EpilogueMatmul(hidden, weight, bias, width, temperature, None, group_top2=True)(column_start, width)
    assert ours.tile_max2.shape == (rows, -(-width // 128)) and ours.group_columns == 32
    groups = min(ours.group_max.shape[1], theirs.group_max.shape[1])  # past the width: 4 groups more or fewer
    for name in ("group_max", "group_second"):
        assert torch.equal(getattr(ours, name)[:, :groups], getattr(theirs, name)[:, :groups]), name
    unique = ours.group_max[:, :groups] > ours.group_second[:, :groups]
    assert unique.float().mean() > 0.9
    assert torch.equal(ours.group_arg[:, :groups][unique], theirs.group_arg[:, :groups][unique])
    # against float64: each group's maximum, and the row's logsumexp from the 128-column tiles
    exact = reference.lm_head_logits(hidden, weight[column_start:column_start + width],
                                      bias[column_start:column_start + width] if with_bias else None)
    table = top2_group_column_table(ours.group_max.shape[1], 32).to(exact.device)
    padded = torch.nn.functional.pad(exact, (0, table.numel() - width), value=float("-inf"))
    exact_max = padded[:, table].amax(dim=-1)
    finite = exact_max.isfinite()
    assert torch.allclose(ours.group_max.double()[finite], exact_max[finite], atol=2e-4, rtol=1e-5)
    assert not ours.group_max[~finite].isfinite().any()
    row_max2 = ours.tile_max2.double().amax(dim=1, keepdim=True)
    lse = (row_max2[:, 0] + torch.log2((ours.tile_sum2.double() * torch.exp2(ours.tile_max2.double() - row_max2))
                                       .sum(dim=1))) * torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert torch.allclose(lse, torch.logsumexp(exact / temperature, dim=-1), atol=2e-4, rtol=0)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("k", [1, 64])
def test_the_maxima_schedule_gives_the_same_top_k_on_either_matmul(k, monkeypatch):
    hidden, weight, bias = _problem(1500, 1024, 32_000, torch.bfloat16, True, seed=k)
    hidden = hidden * 4  # peaked rows: groups holding two or more of the top-k, computed again
    tops = {}
    for matmul in ("pingpong", "triton"):
        monkeypatch.setenv("KD_KERNELS_TOP2_MATMUL", matmul)
        tops[matmul] = teacher_topk_maxima(hidden, weight, k, 2.0, 32_000, bias, chunk_rows=512)
    assert torch.equal(tops["pingpong"].indices, tops["triton"].indices)
    assert torch.allclose(tops["pingpong"].logprobs, tops["triton"].logprobs, atol=2e-6, rtol=0)
    expected = reference.teacher_topk(hidden, weight, k, 2.0, 32_000, bias)
    check_teacher_topk(tops["pingpong"], expected, 2e-4, reference.lm_head_logits(hidden, weight, bias), 2.0,
                       32_000)
