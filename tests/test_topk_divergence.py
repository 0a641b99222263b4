"""The Triton student loss against the float64 reference: losses, gradients, metrics.

On CPU the kernels run under TRITON_INTERPRET=1 (fp32 and fp16, tiny shapes); the `gpu`
tests run real shapes in bf16 and fp32 on a CUDA device.
"""
import pytest
import torch

import kd_kernels as kd
from kd_kernels.options import DIVERGENCES

from helpers import HAS_CUDA, relative_error

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _problem(n=37, h=16, v=203, k=5, vocab_size=200, ignored=0.2, dtype=torch.float32, seed=0, scale=1.0,
             temperature=2.0, device=DEVICE):
    generator = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(n, h, generator=generator)).to(device, dtype)
    weight = torch.randn(v, h, generator=generator).to(device, dtype)
    bias = torch.randn(v, generator=generator).to(device, dtype)
    teacher = kd.teacher_topk(torch.randn(n, h, generator=generator).to(device) * scale,
                              torch.randn(v, h, generator=generator).to(device), k=k, temperature=temperature,
                              vocab_size=vocab_size, backend="torch")
    labels = torch.randint(0, vocab_size, (n,), generator=generator)
    labels[torch.rand(n, generator=generator) < ignored] = -100
    return hidden, weight, bias, teacher, labels.to(device)


def _grads(loss, inputs, upstream):
    return torch.autograd.grad(loss, inputs, upstream)


def _compare(problem, tolerance, chunk_rows=16, lean=False, **options):
    hidden, weight, bias, teacher, labels = problem
    if lean:
        chunk_rows = None
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    leaves64 = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    kwargs = {"temperature": 2.0, "ce_weight": 0.5, "vocab_size": 200, **options}  # options may override
    expected = kd.topk_divergence(leaves64[0], leaves64[1], teacher, labels, bias=leaves64[2], backend="torch", **kwargs)
    got = kd.topk_divergence(leaves[0], leaves[1], teacher, labels, bias=leaves[2], backend="triton",
                             chunk_rows=chunk_rows, lean=lean, **kwargs)
    assert got.dtype == torch.float32
    assert relative_error(got, expected) <= tolerance
    upstream = torch.rand_like(expected) + 0.5  # != 1, and per row for reduction="none"
    for name, g, r in zip(("hidden", "weight", "bias"), _grads(got, leaves, upstream.float()),
                          _grads(expected, leaves64, upstream)):
        assert g.dtype == hidden.dtype
        assert relative_error(g, r) <= tolerance, name


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_every_divergence_and_support_fp32(divergence, support):
    _compare(_problem(seed=DIVERGENCES.index(divergence)), 1e-5, divergence=divergence, support=support, beta=0.3)


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "skewed_reverse_kl"])
def test_fp16_inputs(divergence, support):
    _compare(_problem(dtype=torch.float16, seed=3), 5e-3, divergence=divergence, support=support)


@pytest.mark.parametrize("ignored", [0.0, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_and_ignored_rows(reduction, ignored):
    _compare(_problem(ignored=ignored, seed=5), 1e-5, reduction=reduction, support="tail")


def _two_passes(monkeypatch):
    """The two-pass gradient (the form of fp16 rows and of two dense terms) for every input."""
    from kd_kernels.autograd import student_loss

    monkeypatch.setattr(student_loss, "one_read_exp_weight", lambda *args: None)


@pytest.mark.parametrize("passes", ["one", "two"])
@pytest.mark.parametrize("support, temperature, ce_weight", [
    ("tail", 1.0, 0.5),  # one read, w = 1: CE's and the tail's softmax are one term
    ("tail", 2.0, 0.0),  # one read, w = 1 / τ: the tail's term alone
    ("renormalized", 2.0, 0.5),  # one read, w = 1: CE's term alone
    ("tail", 2.0, 0.5),  # two dense terms: two passes either way
])
def test_one_read_and_two_passes_match_the_reference(monkeypatch, passes, support, temperature, ce_weight):
    # a bias spike 30 above every other logit at a column no id or label holds, past the
    # interpreter's first blocks of 64: the one-read pass must move its shift and rescale
    if passes == "two":
        _two_passes(monkeypatch)
    hidden, weight, bias, teacher, labels = _problem(seed=11, temperature=temperature)
    bias = bias.clone()
    bias[150] = 30.0 + 20.0 / temperature
    keep = (teacher.indices != 150).all(1) & (labels != 150)
    problem = (hidden[keep], weight, bias, kd.TopK(teacher.logprobs[keep], teacher.indices[keep], temperature),
               labels[keep])
    _compare(problem, 1e-5, support=support, temperature=temperature, ce_weight=ce_weight, divergence="jsd",
             chunk_rows=8)


def test_the_gradient_takes_one_read_where_it_has_one_dense_term_in_bf16_or_fp32():
    from kd_kernels.autograd.student_loss import one_read_exp_weight
    from kd_kernels.options import DivergenceOptions

    def weight(dtype=torch.float32, has_labels=True, **options):
        return one_read_exp_weight(DivergenceOptions(**options), has_labels, dtype)

    assert weight(support="renormalized", temperature=2.0, ce_weight=0.5) == 1.0  # CE's softmax(z) alone
    assert weight(support="tail", temperature=1.0, ce_weight=0.5) == 1.0  # one softmax at τ = 1
    assert weight(support="tail", temperature=4.0, ce_weight=0.0) == 0.25  # the tail's softmax(z / τ) alone
    assert weight(support="tail", temperature=4.0, ce_weight=0.0, dtype=torch.bfloat16) == 0.25
    assert weight(support="tail", temperature=4.0, ce_weight=0.5, has_labels=False) == 0.25  # no CE without labels
    assert weight(support="tail", temperature=4.0, ce_weight=0.5) is None  # two dense terms
    assert weight(support="renormalized", temperature=2.0, dtype=torch.float16) is None  # e' could leave fp16


def test_num_tokens_and_one_chunk_and_beta_endpoints():
    problem = _problem(seed=6)
    _compare(problem, 1e-5, num_tokens=100, chunk_rows=None)
    _compare(problem, 1e-5, num_tokens=torch.tensor(100.0, device=DEVICE), divergence="jsd", beta=0.0)
    _compare(problem, 1e-5, divergence="jsd", beta=1.0, support="tail")


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_labels_among_the_ids_and_missing_entries(divergence, support):
    # where gradients land on one column twice: the label among the teacher's ids, and
    # missing entries (-inf, id 0) beside a label 0 or a valid id 0
    hidden, weight, bias, teacher, labels = _problem(seed=18, k=6)
    logprobs, indices = teacher.logprobs.clone(), teacher.indices.clone()
    rows = torch.arange(hidden.shape[0], device=labels.device)
    labels = torch.where(rows % 3 == 0, indices[:, 1].long(), labels)  # the label is the second id
    missing = rows % 4 == 1
    logprobs[missing, 4:] = -float("inf")
    indices[missing, 4:] = 0
    labels = torch.where(rows % 8 == 1, 0, labels)  # a missing row whose label is column 0
    indices[rows % 8 == 5, 3] = 0  # a missing row with a valid id 0 as well
    problem = (hidden, weight, bias, kd.TopK(logprobs, indices, temperature=2.0), labels)
    _compare(problem, 1e-5, divergence=divergence, support=support, beta=0.3)


def test_large_logits_and_low_temperature_stay_finite():
    hidden, weight, bias, teacher, labels = _problem(scale=25.0, seed=7, temperature=0.25)
    hidden.requires_grad_()
    loss = kd.topk_divergence(hidden, weight, teacher, labels, temperature=0.25, support="tail", ce_weight=1.0,
                              vocab_size=200, backend="triton", chunk_rows=16)
    (grad,) = torch.autograd.grad(loss, hidden)
    expected = kd.topk_divergence(hidden.double(), weight.double(), teacher, labels, temperature=0.25, support="tail",
                                  ce_weight=1.0, vocab_size=200, backend="torch")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert relative_error(loss, expected) <= 1e-5


def test_gradient_to_only_one_of_hidden_and_weight():
    hidden, weight, _, teacher, labels = _problem(seed=8)
    weight.requires_grad_()
    loss = kd.topk_divergence(hidden, weight, teacher, labels, temperature=2.0, vocab_size=200, backend="triton",
                              chunk_rows=16)
    (grad_weight,) = torch.autograd.grad(loss, weight)
    weight64 = weight.detach().double().requires_grad_()
    expected = kd.topk_divergence(hidden.double(), weight64, teacher, labels, temperature=2.0, vocab_size=200,
                                  backend="torch")
    assert relative_error(grad_weight, torch.autograd.grad(expected, weight64)[0]) <= 1e-5


@pytest.fixture
def small_lean_chunks(monkeypatch):
    """Lean chunks of 8 rows at these tiny shapes (37 rows: 5 chunks, the last short), so dW
    adds up over several chunks as it does at real sizes."""
    from kd_kernels.autograd import student_loss

    monkeypatch.setattr(student_loss, "LEAN_ROW_MULTIPLE", 8)
    monkeypatch.setattr(student_loss, "LEAN_CHUNK_BYTES", 8 * 203 * 4 + 100)


def test_lean_chunks_stay_under_the_budget_whatever_n():
    from kd_kernels.autograd.student_loss import LEAN_CHUNK_BYTES, lean_chunk_rows

    assert lean_chunk_rows(8192, 151_936) == 384  # the measured lean setting (benchmarks/RESULTS.md)
    for num_rows, num_columns in ((8192, 151_936), (100_000, 128_256), (50, 262_144), (7, 1000)):
        rows = lean_chunk_rows(num_rows, num_columns)
        assert 1 <= rows <= num_rows and (4 * rows * num_columns <= LEAN_CHUNK_BYTES or rows == 64)


FP32, FP16 = (torch.float32, 1e-5), (torch.float16, 5e-3)


# every pair of values of any two of (divergence, support, reduction, dtype) in some case
@pytest.mark.parametrize("divergence, support, reduction, dtype, tolerance", [
    ("forward_kl", "renormalized", "mean", *FP32), ("forward_kl", "tail", "none", *FP16),
    ("adaptive_kl", "renormalized", "none", *FP32), ("adaptive_kl", "tail", "mean", *FP16),
    ("tvd", "renormalized", "mean", *FP16), ("tvd", "tail", "none", *FP32)])
def test_lean_schedule(divergence, support, reduction, dtype, tolerance, small_lean_chunks):
    _compare(_problem(seed=14, dtype=dtype), tolerance, lean=True, divergence=divergence, support=support,
             reduction=reduction)


def test_metrics_and_argmax_ties():
    hidden, weight, bias, _, labels = _problem(seed=14)
    # the student's maximum is tied at columns 7, 20 and 71 (7 and 71 in one lane of the
    # interpreter's 64-column blocks) and 150: its argmax must be 7, the teacher's top-1
    # everywhere, so top-1 agreement counts every row
    weight[[7, 20, 71, 150]] = 0.0
    bias[[7, 20, 71, 150]] = 60.0  # z = 60 exactly there, every other logit is far below
    teacher_logits = torch.randn(hidden.shape[0], 200, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    teacher_logits[:, 7] = 30.0
    teacher = kd.teacher_topk_from_logits(teacher_logits, k=5, temperature=2.0, backend="torch")
    kwargs = dict(temperature=2.0, ce_weight=0.5, vocab_size=200, bias=bias, return_metrics=True)
    _, metrics = kd.topk_divergence(hidden, weight, teacher, labels, backend="triton", chunk_rows=16, **kwargs)
    _, expected = kd.topk_divergence(hidden.double(), weight.double(), teacher, labels, backend="torch",
                                     **{**kwargs, "bias": bias.double()})
    assert metrics["top1_agreement_sum"].item() == metrics["rows"].item() > 0
    for name in expected:
        assert metrics[name].item() == pytest.approx(expected[name].item(), rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize("lean", [False, True])
def test_metrics_match_reference(lean, small_lean_chunks):
    hidden, weight, bias, teacher, labels = _problem(seed=9)
    kwargs = dict(temperature=2.0, ce_weight=0.5, vocab_size=200, bias=bias, return_metrics=True)
    _, metrics = kd.topk_divergence(hidden, weight, teacher, labels, backend="triton",
                                    chunk_rows=None if lean else 16, lean=lean, **kwargs)
    _, expected = kd.topk_divergence(hidden.double(), weight.double(), teacher, labels, backend="torch",
                                     **{**kwargs, "bias": bias.double()})
    for name in expected:
        assert metrics[name].item() == pytest.approx(expected[name].item(), rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("support", ["renormalized", "tail"])
def test_from_logits(support, dtype):
    hidden, weight, _, teacher, labels = _problem(seed=10)
    logits = (hidden.double() @ weight.double().T).to(dtype).requires_grad_()
    logits64 = logits.detach().double().requires_grad_()
    kwargs = dict(divergence="skewed_forward_kl", support=support, temperature=2.0, ce_weight=0.3, vocab_size=200)
    got = kd.topk_divergence_from_logits(logits, teacher, labels, backend="triton", **kwargs)
    expected = kd.topk_divergence_from_logits(logits64, teacher, labels, backend="torch", **kwargs)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-3
    assert relative_error(got, expected) <= tolerance
    (grad,) = torch.autograd.grad(got * 1.3, logits)
    (grad64,) = torch.autograd.grad(expected * 1.3, logits64)
    assert grad.dtype == dtype and relative_error(grad, grad64) <= tolerance
    assert (grad[:, 200:] == 0).all()


def test_inside_torch_compile_of_the_surrounding_model():
    hidden, weight, _, teacher, labels = _problem(seed=11)
    projection = torch.nn.Linear(16, 16).to(DEVICE)

    def step(x):
        return kd.topk_divergence(torch.tanh(projection(x)), weight, teacher, labels, temperature=2.0,
                                  vocab_size=200, backend="triton", chunk_rows=16, check_values=False)

    compiled = torch.compile(step, backend="aot_eager")
    loss = compiled(hidden)
    loss.backward()
    expected = step(hidden)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.isfinite(projection.weight.grad).all()


GPU_CASES = [(d, s, dtype, tol, False) for d in DIVERGENCES for s in ("renormalized", "tail")
             for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5))] + [
    (d, s, torch.bfloat16, 2e-2, True) for d in ("forward_kl", "jsd", "adaptive_kl") for s in ("renormalized", "tail")]


@pytest.mark.gpu
@pytest.mark.parametrize("divergence, support, dtype, tolerance, lean", GPU_CASES)
def test_gpu_real_shape(divergence, support, dtype, tolerance, lean):
    torch.backends.cuda.matmul.allow_tf32 = False
    n, h, v, k = 2048, 1024, 151_936, 64
    hidden, weight, _, teacher, labels = _problem(n=n, h=h, v=v, k=k, vocab_size=151_900, dtype=dtype, seed=12,
                                                  scale=0.1)
    hidden.requires_grad_(), weight.requires_grad_()
    kwargs = dict(divergence=divergence, support=support, temperature=2.0, ce_weight=0.5, vocab_size=151_900)
    got = kd.topk_divergence(hidden, weight, teacher, labels, backend="triton", lean=lean, **kwargs)
    grads = torch.autograd.grad(got, (hidden, weight))
    hidden64, weight64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    expected = kd.topk_divergence(hidden64, weight64, teacher, labels, backend="torch", **kwargs)
    expected_grads = torch.autograd.grad(expected, (hidden64, weight64))
    assert relative_error(got, expected) <= tolerance
    for g, r in zip(grads, expected_grads):
        assert relative_error(g, r) <= tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("support, temperature, ce_weight, scale", [
    ("tail", 1.0, 1.0, 0.1),  # the benchmark's case: one read, w = 1
    ("tail", 2.0, 0.0, 0.1),  # one read, w = 1 / τ
    ("tail", 0.25, 0.0, 3.0),  # logits ~100 at τ = 0.25: the shift moves in most rows
])
def test_gpu_one_read_against_two_passes_and_the_reference(monkeypatch, dtype, support, temperature, ce_weight,
                                                           scale):
    """Both forms within the tolerance of float64 (bf16: the issue's 1 %; fp32: 1e-5, 1e-4 for
    logits ~100 at τ = 0.25, whose float32 rounding moves the gradient by ~3e-5 in both forms),
    and the one-read form no further from it than 1.25 × the two-pass form's error plus noise."""
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5 if scale < 1 else 1e-4
    torch.backends.cuda.matmul.allow_tf32 = False
    n, h, v, k = 2048, 1024, 151_936, 64
    hidden, weight, _, teacher, labels = _problem(n=n, h=h, v=v, k=k, vocab_size=151_900, dtype=dtype, seed=14,
                                                  scale=scale, temperature=temperature)
    kwargs = dict(divergence="forward_kl", support=support, temperature=temperature, ce_weight=ce_weight,
                  vocab_size=151_900)
    hidden64, weight64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    expected = kd.topk_divergence(hidden64, weight64, teacher, labels, backend="torch", **kwargs)
    expected_grads = torch.autograd.grad(expected, (hidden64, weight64))
    errors = {}
    for passes in ("one", "two"):
        if passes == "two":
            _two_passes(monkeypatch)
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
        got = kd.topk_divergence(*leaves, teacher, labels, backend="triton", **kwargs)
        grads = torch.autograd.grad(got, leaves)
        errors[passes] = [relative_error(got, expected)] + [relative_error(g, r) for g, r in zip(grads, expected_grads)]
    for one, two in zip(errors["one"], errors["two"]):
        assert one <= tolerance and two <= tolerance, errors
        assert one <= 1.25 * two + (2e-4 if dtype == torch.bfloat16 else 1e-7), errors


def test_second_backward_through_the_same_graph_is_refused():
    hidden, weight, _, teacher, labels = _problem(seed=13)
    hidden.requires_grad_()
    loss = kd.topk_divergence(hidden, weight, teacher, labels, temperature=2.0, vocab_size=200, backend="triton",
                              chunk_rows=16)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
