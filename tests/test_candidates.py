"""The merge of top-k candidate sets (kd_kernels/candidates.py), which the teacher's tiled
schedule and vocab-parallel ranks use, against the float64 reference's top-k of whole rows:
ties across sets, sets with fewer columns than k, float32 candidates."""
import pytest
import torch

from kd_kernels import reference
from kd_kernels.candidates import merge_candidates, top_of_candidates


def _parts(logits: torch.Tensor, bounds, k: int, temperature: float):
    """Each column slice's top-k (stable: the lower id first on ties; -inf at id 0 past a slice's
    columns) concatenated in slice order, and each slice's logsumexp ``[N, slices]``."""
    values, ids, lses = [], [], []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        tempered = logits[:, start:stop] / temperature
        ranked, order = torch.sort(tempered, dim=-1, descending=True, stable=True)
        missing = k - ranked.shape[1]
        if missing > 0:
            ranked = torch.cat([ranked, ranked.new_full((ranked.shape[0], missing), float("-inf"))], -1)
            order = torch.cat([order + start, order.new_zeros((order.shape[0], missing))], -1)
        else:
            order = order + start
        values.append(ranked[:, :k])
        ids.append(order[:, :k])
        lses.append(torch.logsumexp(tempered, dim=-1))
    return torch.cat(values, -1), torch.cat(ids, -1), torch.stack(lses, -1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bounds, k", [((0, 40, 41, 100, 203), 8), ((0, 3, 203), 5), ((0, 100, 203), 1)])
def test_merge_equals_the_top_k_of_the_whole_row(bounds, k, dtype):
    # bounds (0, 3, 203) with k = 5: the first slice has fewer columns than k
    logits = torch.randn(9, 203, generator=torch.Generator().manual_seed(k), dtype=torch.float64).round(decimals=1)
    logits[0, [150, 2, 77, 40]] = 9.0  # ties in three slices, the lower id first
    values, ids, lses = _parts(logits.to(dtype), bounds, k, 0.5)
    merged = merge_candidates(values, ids, lses, k, 0.5)
    expected = reference.teacher_topk_from_logits(logits, k, 0.5)
    assert merged.indices.dtype == torch.int32 and merged.temperature == 0.5
    assert torch.equal(merged.indices, expected.indices)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(merged.logprobs.double(), expected.logprobs, atol=tolerance, rtol=0)
    assert torch.allclose(merged.lse.double(), expected.lse, atol=tolerance, rtol=0)
    if k == 8:
        assert merged.indices[0, :4].tolist() == [2, 40, 77, 150]


def test_a_row_with_fewer_columns_than_k_gets_minus_inf_at_id_0():
    logits = torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.float64)
    values, ids, lses = _parts(logits, (0, 1, 3), 4, 1.0)
    merged = merge_candidates(values, ids, lses, 4, 1.0)
    assert merged.indices.tolist() == [[1, 2, 0, 0]]
    assert torch.isneginf(merged.logprobs[0, 3]) and torch.isfinite(merged.logprobs[0, 2])
    assert torch.allclose(merged.logprobs[0, :3], torch.log_softmax(logits, -1)[0, [1, 2, 0]])


def test_top_of_candidates_keeps_the_sets_order_among_equal_values():
    values = torch.tensor([[5.0, 1.0, 5.0, 4.0, float("-inf")]])
    ids = torch.tensor([[3, 9, 10, 12, 0]])
    top, top_ids = top_of_candidates(values, ids, 3)
    assert top.tolist() == [[5.0, 5.0, 4.0]] and top_ids.tolist() == [[3, 10, 12]]
