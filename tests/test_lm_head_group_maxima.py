"""The teacher's epilogue matmul (ops/lm_head_group_maxima.py) storing its logits: the logits,
each row's tile statistics (the logsumexp without reading the logits back) and each group's
maximum against the float64 reference; the buffers and inputs it refuses. Its group top-2 is
tested in tests/test_teacher_maxima.py, its appends in tests/test_teacher_appended.py.
Interpreter tiles: 16 rows × 32 columns, groups of 8."""
import math

import pytest
import torch

from helpers import FLOAT32_INTERPRETED, HAS_CUDA, INTERPRETER_ONLY
from kd_kernels import reference
from kd_kernels.ops import lm_head_group_maxima
from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul, default_config, lm_head_logits_with_summaries

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype", [FLOAT32_INTERPRETED, torch.float16])
@pytest.mark.parametrize("temperature, with_bias, width", [(1.0, False, 203), (0.5, True, 200), (2.0, True, 77)])
def test_logits_statistics_and_group_maxima(dtype, temperature, with_bias, width):
    generator = torch.Generator().manual_seed(width)
    hidden = torch.randn(21, 16, generator=generator).to(DEVICE, dtype)  # 2 row tiles, the second partial
    weight = torch.randn(203, 16, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(203, generator=generator).to(DEVICE, dtype) if with_bias else None
    logits = torch.empty(21, -(-width // 4) * 4, dtype=torch.float32, device=DEVICE)  # rows at 16-byte boundaries
    summaries = lm_head_logits_with_summaries(hidden, weight, bias, width, temperature, logits)
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


@pytest.mark.parametrize("dtype", [FLOAT32_INTERPRETED, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_logits_alone_without_summaries(dtype, with_bias):
    """``summaries=False`` (the floors' sample): the same logits, in the inputs' dtype too, and
    no statistics (nothing written through the operands standing in for them); it refuses what
    needs them."""
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(21, 16, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(203, 16, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(68, generator=generator).to(DEVICE, dtype) if with_bias else None
    hidden_before = hidden.clone()
    logits = torch.full((21, 80), float("nan"), dtype=dtype, device=DEVICE)
    matmul = EpilogueMatmul(hidden, weight[::3], bias, 68, 1.0, logits, summaries=False)
    assert matmul(0, 40) is None and matmul(0, 68) is None  # a narrower call (junk past its width), then all
    assert torch.equal(hidden, hidden_before)
    exact = reference.lm_head_logits(hidden, weight[::3], bias)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(logits[:, :68].double().cpu(), exact.cpu(), atol=tolerance, rtol=tolerance)
    for refused in (dict(logits=None), dict(group_top2=True)):
        arguments = dict(logits=logits, summaries=False) | refused
        with pytest.raises(ValueError, match="summaries: a matmul without summaries stores logits"):
            EpilogueMatmul(hidden, weight[::3], None, 68, 1.0, **arguments)


def test_the_logits_buffer_must_take_tma_stores():
    hidden, weight = torch.zeros(4, 16, dtype=torch.float16), torch.zeros(30, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="logits: the teacher's epilogue matmul moves rows by TMA"):
        lm_head_logits_with_summaries(hidden, weight, None, 30, 1.0, torch.empty(4, 30))  # 120-byte rows
    # float32, or the inputs' own dtype (the appended schedule's sample): nothing else
    with pytest.raises(ValueError, match="logits: expected a float32 buffer .* or one of the inputs' dtype "
                                         "torch.float16 .*, got torch.bfloat16"):
        lm_head_logits_with_summaries(hidden, weight, None, 30, 1.0, torch.empty(4, 32, dtype=torch.bfloat16))


@INTERPRETER_ONLY
def test_the_epilogue_matmul_refuses_float32_natively(monkeypatch):
    # the check runs before any launch; the GPU's config it makes is cached apart from the interpreter's
    monkeypatch.setattr(lm_head_group_maxima, "INTERPRETED", False)
    hidden, weight = torch.zeros(4, 16), torch.zeros(30, 16)
    with pytest.raises(ValueError, match="hidden: the epilogue matmul takes bf16 / fp16 on a GPU .* got torch.float32"):
        EpilogueMatmul(hidden, weight, None, 30, 1.0, None)
