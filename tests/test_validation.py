"""Every bad input of the SPEC raises a clear error naming the argument, before any math."""
import math

import pytest
import torch

import kd_kernels as kd
from kd_kernels import TopK


def _inputs(n=4, h=3, v=10, k=3):
    hidden, weight = torch.randn(n, h), torch.randn(v, h)
    teacher = kd.teacher_topk(torch.randn(n, h), torch.randn(v, h), k=k)
    return hidden, weight, teacher, torch.tensor([1, 2, -100, 9][:n])


def _raises(error, match, **overrides):
    hidden, weight, teacher, labels = _inputs()
    args = dict(hidden=hidden, weight=weight, teacher=teacher, labels=labels)
    args.update(overrides)
    with pytest.raises(error, match=match):
        kd.topk_divergence(args.pop("hidden"), args.pop("weight"), args.pop("teacher"), args.pop("labels"), **args)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(divergence="kl"), ValueError, "divergence"),
    (dict(support="full"), ValueError, "support"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(beta=1.5), ValueError, "beta"),
    (dict(beta=-0.1), ValueError, "beta"),
    (dict(skew_lambda=2.0), ValueError, "skew_lambda"),
    (dict(adaptive_alpha=-1.0), ValueError, "adaptive_alpha"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=math.inf), ValueError, "temperature"),
    (dict(labels=None, ce_weight=0.5), ValueError, "labels"),
    (dict(hidden=torch.randint(0, 3, (4, 3))), TypeError, "hidden"),
    (dict(hidden=torch.randn(4, 3, dtype=torch.complex64)), TypeError, "hidden"),
    (dict(hidden=torch.randn(4, 3, 1)), ValueError, "hidden"),
    (dict(weight=torch.randn(10, 4)), ValueError, "weight"),
    (dict(weight=torch.randn(10, 3, dtype=torch.float64)), TypeError, "weight"),
    (dict(bias=torch.randn(9)), ValueError, "bias"),
    (dict(labels=torch.tensor([1, 2, 3])), ValueError, "labels"),
    (dict(labels=torch.tensor([1.0, 2, 3, 4])), TypeError, "labels"),
    (dict(labels=torch.tensor([1, 2, 3, 10])), ValueError, "labels"),
    (dict(labels=torch.tensor([1, 2, 3, -1])), ValueError, "labels"),
    (dict(vocab_size=11), ValueError, "vocab_size"),
    (dict(vocab_size=0), ValueError, "vocab_size"),
    (dict(num_tokens=0), ValueError, "num_tokens"),
    (dict(teacher=(torch.zeros(4, 3), torch.zeros(4, 3))), TypeError, "teacher"),
    (dict(teacher=TopK(torch.zeros(5, 3), torch.zeros(5, 3, dtype=torch.int32))), ValueError, "teacher.logprobs"),
    (dict(teacher=TopK(torch.zeros(4, 3), torch.zeros(4, 3))), TypeError, "teacher.indices"),
    (dict(teacher=TopK(torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.int32))), ValueError, "teacher.indices"),
    (dict(teacher=TopK(torch.full((4, 3), -1.0), torch.full((4, 3), 10, dtype=torch.int32))), ValueError, "teacher.indices"),
    (dict(teacher=TopK(torch.full((4, 3), -1.0), torch.full((4, 3), -2, dtype=torch.int32))), ValueError, "teacher.indices"),
    (dict(teacher=TopK(torch.full((4, 3), math.nan), torch.zeros(4, 3, dtype=torch.int32))), ValueError, "NaN"),
    (dict(teacher=TopK(torch.full((4, 3), 2.0), torch.zeros(4, 3, dtype=torch.int32)), support="tail"), ValueError,
     "logits"),
    (dict(teacher=TopK(torch.full((4, 3), -1.0), torch.zeros(4, 3, dtype=torch.int32), temperature=2.0)), ValueError,
     "temperature"),
    (dict(backend="gpu"), ValueError, "backend"),
    (dict(chunk_rows=0), ValueError, "chunk_rows: expected None or an int >= 1, got 0"),
    (dict(chunk_rows=2.0), ValueError, "chunk_rows: expected None or an int >= 1, got 2.0"),
    (dict(chunk_rows=2, lean=True), ValueError, "chunk_rows: lean=True sets its own chunks"),
    (dict(lean="yes"), TypeError, "lean: expected a bool, got str"),
])
def test_topk_divergence_rejects(overrides, error, match):
    _raises(error, match, **overrides)


def test_ids_past_vocab_size_are_rejected_and_check_can_be_turned_off():
    hidden, weight, _, labels = _inputs()
    teacher = TopK(torch.full((4, 3), -1.0), torch.full((4, 3), 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="teacher.indices"):
        kd.topk_divergence(hidden, weight, teacher, labels, vocab_size=8)
    kd.topk_divergence(hidden, weight, teacher, None, vocab_size=9, check_values=False)


@pytest.mark.parametrize("call, match", [
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 3), k=0), "k"),
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 3), k=11), "k"),
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 3), k=9, vocab_size=8), "k"),
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 3), k=2, temperature=0), "temperature"),
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 4), k=2), "weight"),
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 3), k=2, logprobs_dtype=torch.int8), "logprobs_dtype"),
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 3), k=2, chunk_rows=-1), "chunk_rows: expected None"),
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 3), k=2, chunk_rows=4, lean=True),
     "chunk_rows: lean=True sets its own chunks"),
    (lambda: kd.teacher_topk(torch.randn(4, 3), torch.randn(10, 3), k=2, lean=1), "lean: expected a bool, got int"),
    (lambda: kd.teacher_topk_from_logits(torch.randint(0, 5, (4, 10)), k=2), "logits"),
    (lambda: kd.teacher_topk_from_logits(torch.randn(10), k=2), "logits"),
    (lambda: kd.teacher_topk_from_logits(torch.randn(4, 10), k=2, vocab_size=12), "vocab_size"),
])
def test_teacher_topk_rejects(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_backend_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    from kd_kernels import backends

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backends._triton_status.cache_clear()
    try:
        hidden, weight, teacher, labels = _inputs()
        with pytest.raises((RuntimeError, ValueError), match="backend"):
            kd.topk_divergence(hidden, weight, teacher, labels, backend="triton")
    finally:
        backends._triton_status.cache_clear()


def test_nothing_passed_in_is_modified():
    hidden, weight, teacher, labels = _inputs()
    bias = torch.randn(10)
    teacher = TopK(teacher.logprobs.clone(), teacher.indices.clone(), teacher.lse, teacher.temperature)
    teacher.logprobs[0, -1] = -math.inf
    originals = [t.clone() for t in (hidden, weight, bias, teacher.logprobs, teacher.indices, labels)]
    hidden.requires_grad_()
    loss = kd.topk_divergence(hidden, weight, teacher, labels, support="tail", ce_weight=0.5, bias=bias)
    loss.backward()
    kd.teacher_topk(hidden.detach(), weight, k=3, bias=bias)
    for before, after in zip(originals, (hidden.detach(), weight, bias, teacher.logprobs, teacher.indices, labels)):
        assert torch.equal(before, after)
