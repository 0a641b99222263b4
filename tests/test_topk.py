"""TopK helpers: valid, tail_mass, to, pack / unpack."""
import math

import pytest
import torch

from kd_kernels import TopK


def _topk(n=5, k=4, lse=True):
    logprobs = torch.log_softmax(torch.randn(n, 100), -1).topk(k).values
    logprobs[0, -1] = -math.inf
    indices = torch.randint(0, 100, (n, k), dtype=torch.int32)
    return TopK(logprobs, indices, torch.randn(n) if lse else None, 2.0)


def test_valid_and_tail_mass():
    top = TopK(torch.tensor([[math.log(0.5), math.log(0.25), -math.inf]]), torch.tensor([[3, 1, 0]], dtype=torch.int32))
    assert top.valid.tolist() == [[True, True, False]]
    assert top.tail_mass.item() == pytest.approx(0.25, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_lse", [True, False])
def test_pack_unpack_round_trip(dtype, with_lse):
    top = _topk(lse=with_lse)
    buffer = top.pack(dtype)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()
    back = TopK.unpack(buffer)
    assert torch.equal(back.indices, top.indices)
    assert torch.equal(back.logprobs, top.logprobs.to(dtype))
    assert back.temperature == 2.0
    assert (back.lse is None) == (not with_lse)
    if with_lse:
        assert torch.equal(back.lse, top.lse)


def test_packed_bfloat16_costs_six_bytes_per_entry_plus_header():
    top = _topk(n=64, k=32, lse=False)
    assert top.pack(torch.bfloat16).numel() == 64 * 32 * 6 + 64


def test_unpack_rejects_foreign_buffers():
    with pytest.raises(ValueError, match="buffer"):
        TopK.unpack(torch.zeros(128, dtype=torch.uint8))
    with pytest.raises(TypeError, match="buffer"):
        TopK.unpack(torch.zeros(128, dtype=torch.float32))
    good = _topk().pack()
    with pytest.raises(ValueError, match="bytes"):
        TopK.unpack(good[:-2])


def test_to_changes_logprobs_dtype_only():
    top = _topk().to(torch.bfloat16)
    assert top.logprobs.dtype == torch.bfloat16 and top.indices.dtype == torch.int32 and top.lse.dtype == torch.float32
