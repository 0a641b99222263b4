"""The vocab-sharded oracle equals the unsharded reference, for 1 to 4 shards."""
import pytest
import torch

from kd_kernels import reference
from kd_kernels.options import DIVERGENCES, DivergenceOptions


def _shards(logits, world):
    """Megatron layout: V padded up to a multiple of world, split evenly."""
    n, v = logits.shape
    local = -(-v // world)
    padded = torch.cat([logits, torch.full((n, local * world - v), 1e4, dtype=logits.dtype)], -1)  # padding would win
    return list(padded.split(local, dim=-1))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 4, 11])
def test_sharded_teacher_topk_equals_unsharded(world, k):
    logits = torch.randn(6, 23, dtype=torch.float64)
    logits[0, 5] = logits[0, 17]  # a tie across shards: lower id first
    expected = reference.teacher_topk_from_logits(logits, k, temperature=0.7)
    got = reference.teacher_topk_sharded(_shards(logits, world), k, temperature=0.7, vocab_size=23)
    assert torch.equal(got.indices, expected.indices)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-12)
    assert torch.allclose(got.lse, expected.lse, atol=1e-12)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_sharded_student_loss_and_gradients_equal_unsharded(world, support, divergence):
    generator = torch.Generator().manual_seed(world)
    logits = 3 * torch.randn(5, 23, dtype=torch.float64, generator=generator)
    teacher = reference.teacher_topk_from_logits(3 * torch.randn(5, 23, dtype=torch.float64, generator=generator), 6, 2.0)
    labels = torch.tensor([3, -100, 22, 0, 9])
    options = DivergenceOptions(divergence=divergence, support=support, temperature=2.0, ce_weight=0.5, beta=0.3,
                                vocab_size=23)
    padded = torch.cat([logits, torch.zeros(5, 1, dtype=torch.float64)], -1)  # room for the shards' padding
    unsharded = padded[:, :23].clone().requires_grad_()
    expected, expected_metrics = reference.topk_divergence_from_logits(unsharded, teacher, labels, options,
                                                                      return_metrics=True)
    expected.backward()
    leaves = [s.clone().requires_grad_() for s in _shards(logits, world)]
    got, metrics = reference.topk_divergence_sharded(leaves, teacher, labels, options, return_metrics=True)
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-12)
    for name in expected_metrics:
        assert metrics[name].item() == pytest.approx(expected_metrics[name].item(), rel=1e-6)
    sharded_grad = torch.cat([leaf.grad for leaf in leaves], -1)
    assert torch.allclose(sharded_grad[:, :23], unsharded.grad, atol=1e-12)
    assert (sharded_grad[:, 23:] == 0).all()
