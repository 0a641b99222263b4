"""Helpers shared by the tests (conftest.py keeps the pytest hooks)."""
import torch

HAS_CUDA = torch.cuda.is_available()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; inf if actual has a NaN."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    if torch.isnan(actual).any():
        return float("inf")
    denominator = expected.norm()
    if denominator == 0:
        return (actual - expected).norm().item()
    return ((actual - expected).norm() / denominator).item()


def check_teacher_topk(top, expected, atol, logits, temperature, vocab_size):
    """Values position by position within atol; an id may differ from the reference's only
    where its own exact log-prob is within atol of the reference value there (a near-tie
    that float32 accumulation order can flip)."""
    assert top.logprobs.dtype == torch.float32 and top.indices.dtype == torch.int32
    assert torch.allclose(top.logprobs.double().cpu(), expected.logprobs.cpu(), atol=atol, rtol=0)
    exact = torch.log_softmax(logits[:, :vocab_size].double() / temperature, -1)
    exact_at_ours = exact.gather(1, top.indices.long()).cpu()
    same = top.indices.cpu() == expected.indices.cpu()
    assert (same | ((exact_at_ours - expected.logprobs.cpu()).abs() <= atol)).all()
    assert all(len(set(row)) == len(row) for row in top.indices.tolist())
    assert torch.allclose(top.lse.double().cpu(), expected.lse.cpu(), atol=atol, rtol=0)
