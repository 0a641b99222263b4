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
