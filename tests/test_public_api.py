"""The public API on CPU: dispatch to the reference, float dtypes, the nn wrapper, lazy import."""
import subprocess
import sys

import pytest
import torch

import kd_kernels as kd
from kd_kernels import reference
from kd_kernels.options import DivergenceOptions


def test_import_is_fast_and_loads_no_kernels():
    code = ("import time, sys; t = time.perf_counter(); import kd_kernels; dt = time.perf_counter() - t; "
            "print(dt, 'triton' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) < 1.0
    assert out[1] == "False" and out[2] == "False"


def test_cpu_api_equals_reference_in_every_float_dtype():
    hidden, weight, bias = torch.randn(6, 5), torch.randn(13, 5), torch.randn(13)
    teacher = kd.teacher_topk(torch.randn(6, 5), torch.randn(13, 5), k=4, temperature=2.0)
    labels = torch.tensor([0, 12, -100, 3, 4, 5])
    options = DivergenceOptions(divergence="jsd", temperature=2.0, ce_weight=0.5, support="tail")
    expected = reference.topk_divergence(hidden, weight, teacher, labels, options, bias=bias)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = kd.topk_divergence(hidden.to(dtype), weight.to(dtype), teacher, labels, divergence="jsd", temperature=2.0,
                                 ce_weight=0.5, support="tail", bias=bias.to(dtype))
        assert got.dtype == torch.float32
        tolerance = 1e-6 if dtype == torch.float32 else 3e-2
        assert got.item() == pytest.approx(expected.item(), rel=tolerance)


def test_teacher_topk_public_outputs():
    top = kd.teacher_topk(torch.randn(6, 5), torch.randn(13, 5), k=4, logprobs_dtype=torch.bfloat16)
    assert top.logprobs.dtype == torch.bfloat16 and top.indices.dtype == torch.int32 and top.lse.dtype == torch.float32
    assert top.logprobs.shape == (6, 4) and top.temperature == 1.0


def test_nn_module_matches_function():
    hidden, weight = torch.randn(6, 5, requires_grad=True), torch.randn(13, 5)
    teacher = kd.teacher_topk(torch.randn(6, 5), weight, k=4)
    module = kd.TopKDivergenceLoss(divergence="reverse_kl", reduction="sum")
    assert module(hidden, weight, teacher).item() == pytest.approx(
        kd.topk_divergence(hidden, weight, teacher, divergence="reverse_kl", reduction="sum").item())
    with pytest.raises(ValueError, match="divergence"):
        kd.TopKDivergenceLoss(divergence="nope")


def test_available_backends_reports_every_backend_with_a_reason():
    report = kd.available_backends()
    assert set(report) == {"torch", "triton", "cuda"}
    assert all(value.startswith(("available", "unavailable")) for value in report.values())


def test_teacher_topk_builds_no_graph():
    """The teacher is frozen: its top-k must not keep an autograd graph (or its memory)."""
    hidden = torch.randn(6, 5, requires_grad=True)
    weight = torch.randn(13, 5, requires_grad=True)
    top = kd.teacher_topk(hidden, weight, k=3)
    assert not top.logprobs.requires_grad and top.logprobs.grad_fn is None
    top = kd.teacher_topk_from_logits(hidden @ weight.T, k=3)
    assert not top.logprobs.requires_grad and top.logprobs.grad_fn is None
