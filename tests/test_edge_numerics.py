"""Edge numerics of the teacher top-k and the student loss (docs/SPEC.md, "Edge numerics"), on
the torch backend and on the Triton one (under TRITON_INTERPRET=1 on CPU, natively on a GPU), against
float64 values derived independently: -inf student logits at valid teacher ids, a teacher
tail of exactly zero, teacher rows of only -inf logits, out-of-range teacher ids with the
value checks off, float32 on the Triton backend, bf16 under the interpreter. No NaN anywhere.

The float64 limit of a -inf student logit is taken as the reference at a logit of -1e4 in its
place: its probability, exp(-1e4 - lse), is exactly 0 in float64, so every finite term and
every gradient equals its limit (0 · log 0 = 0), and no infinity enters the reference.
"""
import math
import os

import pytest
import torch

import kd_kernels as kd
from helpers import HAS_CUDA, check_teacher_topk, relative_error
from kd_kernels import reference
from kd_kernels.options import DIVERGENCES, DivergenceOptions

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = ["torch", "triton"]
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
FINITE_LIMIT = -1e4  # float64: exp(-1e4 - lse) == 0 exactly for logits of ordinary size
N, V, VOCAB, K, TAU = 6, 203, 200, 5, 2.0  # V* < V: the padded columns exist for nothing


def _teacher(seed, rows=N, k=K, vocab_size=VOCAB, backend="torch"):
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, V, generator=generator)
    return kd.teacher_topk_from_logits(logits.to(DEVICE), k=k, temperature=TAU, vocab_size=vocab_size,
                                       backend=backend), logits


def _student(seed, rows=N):
    return 3 * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed + 1000))


def _loss_and_grad(logits, teacher, labels, backend, upstream, **options):
    """Per-row loss (reduction "none", float64 on the torch backend) and d(Σ upstream · loss)/d logits."""
    leaf = logits.to(DEVICE).requires_grad_()
    kwargs = {"temperature": TAU, "vocab_size": VOCAB, "reduction": "none", **options}
    loss = kd.topk_divergence_from_logits(leaf, teacher, labels, backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(loss, leaf, upstream.to(loss.dtype).to(DEVICE))
    return loss.detach().double().cpu(), grad.double().cpu()


def _assert_no_nan(*tensors):
    for tensor in tensors:
        assert not torch.isnan(tensor).any()


# ---- 1. -inf student logits at valid teacher ids ---------------------------------------------

def _masked_student(teacher, seed):
    """Student logits with -inf at some of the teacher's valid ids (row 0: its 2nd id; row 1: its
    1st and 4th; row 3: a column outside the support); rows 2, 4, 5 untouched. The labels avoid
    the -inf columns (CE would be +inf there)."""
    logits = _student(seed)
    ids = teacher.indices.long().cpu()
    logits[0, ids[0, 1]] = -math.inf
    logits[1, ids[1, [0, 3]]] = -math.inf
    outside = next(c for c in range(VOCAB) if c not in ids[3].tolist())
    logits[3, outside] = -math.inf
    labels = [ids[0, 0].item(), ids[1, 1].item(), _unmasked_column(logits, 2), ids[3, 2].item(), -100,
              _unmasked_column(logits, 5)]
    return logits, torch.tensor(labels).to(DEVICE)


def _unmasked_column(logits, row):
    return next(c for c in range(VOCAB) if torch.isfinite(logits[row, c]))


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_student_logits_at_valid_ids_give_the_limit(backend, divergence, support):
    teacher, _ = _teacher(1)
    logits, labels = _masked_student(teacher, 1)
    upstream = torch.rand(N, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
    options = dict(divergence=divergence, support=support, ce_weight=0.5, beta=0.3, skew_lambda=0.2)
    got, grad = _loss_and_grad(logits, teacher, labels, backend, upstream, **options)
    limit, limit_grad = _loss_and_grad(torch.where(torch.isneginf(logits), FINITE_LIMIT, logits).double(),
                                       teacher, labels, "torch", upstream, **options)
    _assert_no_nan(got, grad)
    # forward KL (and adaptive KL through its head's forward KL) is +inf where q = 0 < p
    infinite = torch.tensor([divergence in ("forward_kl", "adaptive_kl")] * 2 + [False] * (N - 2))
    assert torch.equal(torch.isposinf(got), infinite)
    assert (limit[infinite] > 10).all()  # the finite stand-in: ~p · 1e4 / τ, not +inf
    assert relative_error(got[~infinite], limit[~infinite]) <= 1e-5
    assert torch.isfinite(grad).all() and relative_error(grad, limit_grad) <= 1e-5
    if divergence not in ("forward_kl", "adaptive_kl"):
        masked = torch.isneginf(logits)
        assert (grad[masked] == 0).all()  # no gradient reaches a -inf logit


def _by_hand(divergence, support, teacher_logprobs, student_at_ids, student_lse, beta=0.3):
    """Reverse KL or JSD of one row, float64, the q = 0 bins dropped analytically (0 · log 0 = 0)."""
    if support == "renormalized":
        p = torch.softmax(teacher_logprobs, -1)
        q = torch.softmax(student_at_ids, -1)
    else:
        p, q = teacher_logprobs.exp(), (student_at_ids - student_lse).exp()
        p, q = torch.cat([p, 1 - p.sum(-1, keepdim=True)]), torch.cat([q, 1 - q.sum(-1, keepdim=True)])
    some = q > 0
    if divergence == "reverse_kl":
        return (q[some] * (q[some] / p[some]).log()).sum()
    m = beta * p + (1 - beta) * q
    return beta * (p * (p / m).log()).sum() + (1 - beta) * (q[some] * (q[some] / m[some]).log()).sum()


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_the_limit_drops_the_bins_the_student_gives_no_mass(divergence, support):
    teacher, _ = _teacher(3)
    logits, _ = _masked_student(teacher, 3)
    got = kd.topk_divergence_from_logits(logits.double().to(DEVICE), teacher, None, divergence=divergence,
                                         support=support, temperature=TAU, vocab_size=VOCAB, beta=0.3, reduction="none",
                                         backend="torch").cpu()
    tempered = logits[:, :VOCAB].double() / TAU
    lse = torch.logsumexp(tempered, -1)
    at_ids = tempered.gather(1, teacher.indices.long().cpu())
    for row in range(N):
        expected = _by_hand(divergence, support, teacher.logprobs[row].double().cpu(), at_ids[row], lse[row])
        assert abs(got[row].item() - expected.item()) <= 1e-12 * max(1.0, abs(expected.item()))


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_student_minus_inf_on_every_valid_id(backend, support):
    """Renormalized: q is uniform over the valid ids (equal logits), no gradient reaches them;
    tail: every bin but the tail has q = 0 (the -1e4 stand-in gives the limit)."""
    teacher, _ = _teacher(4)
    logits = _student(4)
    ids = teacher.indices.long().cpu()
    logits[2, ids[2]] = -math.inf
    logits[5, ids[5, :3]] = -math.inf
    upstream = torch.ones(N, dtype=torch.float64)
    for divergence in ("reverse_kl", "forward_kl"):
        options = dict(divergence=divergence, support=support)
        got, grad = _loss_and_grad(logits, teacher, None, backend, upstream, **options)
        _assert_no_nan(got, grad)
        stand_in = torch.where(torch.isneginf(logits), FINITE_LIMIT, logits).double()
        if support == "renormalized":
            stand_in[2, ids[2]] = 0.0  # equal logits: the uniform distribution
        limit, limit_grad = _loss_and_grad(stand_in, teacher, None, "torch", upstream, **options)
        if support == "renormalized":
            limit_grad[2, ids[2]] = 0.0
        infinite = torch.isposinf(limit) | (limit > 100)
        assert torch.equal(torch.isposinf(got), infinite)
        assert relative_error(got[~infinite], limit[~infinite]) <= 1e-5
        assert torch.isfinite(grad).all() and relative_error(grad, limit_grad) <= 1e-5


@pytest.mark.parametrize("support", ["renormalized", "tail"])
def test_minus_inf_bias_through_the_lm_head(support):
    """The fused path from hidden states (cuBLAS logits, the one-read statistics pass): a -inf
    bias at teacher ids, gradients to hidden, weight and bias against the -1e4 stand-in."""
    generator = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(N, 16, generator=generator), torch.randn(V, 16, generator=generator)
    bias = torch.randn(V, generator=generator)
    teacher, _ = _teacher(5)
    ids = teacher.indices.long().cpu()
    bias[ids[0, 1]] = bias[ids[4, 0]] = -math.inf
    labels = torch.tensor([_unmasked_column(bias.expand(N, V), row) + row for row in range(N)])
    labels[2] = -100
    upstream = torch.tensor(1.5)
    results = {}
    for name, b, dtype, backend in (("got", bias, torch.float32, "triton"),
                                    ("limit", torch.where(torch.isneginf(bias), FINITE_LIMIT, bias), torch.float64,
                                     "torch")):
        leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (hidden, weight, b)]
        loss = kd.topk_divergence(leaves[0], leaves[1], teacher, labels.to(DEVICE), bias=leaves[2],
                                  divergence="jsd", beta=0.7, support=support, temperature=TAU, ce_weight=0.5,
                                  vocab_size=VOCAB, backend=backend, chunk_rows=4)
        results[name] = (loss, torch.autograd.grad(loss, leaves, upstream.to(loss.dtype).to(DEVICE)))
    (loss, grads), (limit, limit_grads) = results["got"], results["limit"]
    assert relative_error(loss, limit) <= 1e-5
    for grad, limit_grad in zip(grads, limit_grads):
        _assert_no_nan(grad)
        assert relative_error(grad, limit_grad) <= 1e-5


# ---- 2. a teacher tail of exactly zero -------------------------------------------------------

FINITE, WIDE_K = 12, 16  # the teacher's finite columns, fewer than k


def _finite_columns_teacher(backend, rows=N, columns=V):
    generator = torch.Generator().manual_seed(6)
    teacher_logits = 3 * torch.randn(rows, columns, generator=generator)
    teacher_logits[:, FINITE:] = -math.inf  # a masked vocabulary: fewer than k finite columns
    teacher = kd.teacher_topk_from_logits(teacher_logits.to(DEVICE), k=WIDE_K, backend=backend)
    return teacher, teacher_logits, 3 * torch.randn(rows, columns, generator=generator)


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_teacher_out_of_finite_columns_has_no_tail_bin(backend, divergence):
    teacher, teacher_logits, student_logits = _finite_columns_teacher(backend)
    assert not teacher.valid[:, FINITE:].any() and teacher.valid[:, :FINITE].all()
    leaf = student_logits.to(DEVICE).requires_grad_()
    got = kd.topk_divergence_from_logits(leaf, teacher, None, divergence=divergence, support="tail",
                                         reduction="sum", backend=backend)
    (grad,) = torch.autograd.grad(got, leaf)
    # by hand, float64, from the teacher's exact log-probs: its finite bins and no tail bin
    exact = torch.log_softmax(teacher_logits.double(), -1)
    order = exact.argsort(-1, descending=True)[:, :FINITE]
    leaf64 = student_logits.double().requires_grad_()
    p = exact.gather(1, order).exp()
    q = torch.log_softmax(leaf64, -1).gather(1, order).exp()
    if divergence == "reverse_kl":
        expected = (q * (q / p).log()).sum()
    else:
        m = 0.5 * (p + q)
        expected = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
    (expected_grad,) = torch.autograd.grad(expected, leaf64)
    assert relative_error(got, expected) <= 1e-5
    assert relative_error(grad, expected_grad) <= 1e-5


def test_a_zero_tail_no_longer_depends_on_float32_rounding():
    """The loss does not depend on the float32 rounding of the teacher's log-probs: a float64
    teacher and each backend's float32 one give the same loss on each backend."""
    _, teacher_logits, student_logits = _finite_columns_teacher("torch")
    teachers = {"float64": reference.teacher_topk_from_logits(teacher_logits, WIDE_K)}
    losses = {}
    for backend in BACKENDS:
        teachers[backend] = kd.teacher_topk_from_logits(teacher_logits.to(DEVICE), k=WIDE_K, backend=backend)
        for name in ("float64", backend):
            losses[name, backend] = kd.topk_divergence_from_logits(
                student_logits.to(DEVICE), teachers[name].to(DEVICE), None, divergence="reverse_kl", support="tail",
                backend=backend)
    exact = losses["float64", "torch"]
    assert max(relative_error(loss, exact) for loss in losses.values()) <= 1e-5


# ---- 3. teacher rows of only -inf logits ----------------------------------------------------

def _check_empty_rows(top, rows):
    assert torch.isneginf(top.logprobs[rows]).all() and not top.valid[rows].any()
    assert (top.indices[rows] == 0).all() and torch.isneginf(top.lse[rows]).all()
    _assert_no_nan(top.logprobs, top.lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_rows_of_only_minus_inf_logits(backend):
    generator = torch.Generator().manual_seed(7)
    logits = 3 * torch.randn(N, V, generator=generator)
    logits[1, :VOCAB] = -math.inf  # padding rows; the columns past V* do not exist, whatever they hold
    logits[4, :VOCAB] = -math.inf
    logits[2, 30:VOCAB] = -math.inf  # 30 finite columns, k = 40: missing entries too
    for k in (K, 40):
        top = kd.teacher_topk_from_logits(logits.to(DEVICE), k=k, temperature=TAU, vocab_size=VOCAB, backend=backend)
        _check_empty_rows(top, [1, 4])
        if k == 40:
            assert torch.isneginf(top.logprobs[2, 30:]).all() and (top.indices[2, 30:] == 0).all()
        finite = [0, 2, 3, 5]
        expected = reference.teacher_topk_from_logits(logits[finite], k, TAU, VOCAB)
        got = kd.TopK(top.logprobs[finite], top.indices[finite], top.lse[finite], TAU)
        if k == K:
            check_teacher_topk(got, expected, 1e-5, logits[finite], TAU, VOCAB)
        else:  # the valid entries only: the reference compares -inf entries' log-probs by value
            valid = expected.valid
            assert torch.equal(got.indices.cpu()[valid], expected.indices[valid])
            assert torch.allclose(got.logprobs.double().cpu()[valid], expected.logprobs[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_topk_with_a_minus_inf_bias(backend, dtype):
    """Every column masked: every row has no entry. float16 takes the epilogue-matmul schedule on
    the triton backend (maxima at k <= 64), float32 cuBLAS logits and the selection."""
    generator = torch.Generator().manual_seed(8)
    hidden, weight = torch.randn(4, 16, generator=generator), torch.randn(64, 16, generator=generator)
    bias = torch.full((64,), -math.inf)
    bias[60:] = 1.0  # padded rows of the lm_head, past V*
    top = kd.teacher_topk(hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), k=4, bias=bias.to(DEVICE, dtype),
                          vocab_size=60, backend=backend)
    _check_empty_rows(top, slice(None))


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_teacher_rows_count_for_nothing_in_kd(backend, support):
    """Padding rows (teacher logits all -inf): with an ignored label they count for nothing; with
    a label, for their CE only. The value checks pass them."""
    generator = torch.Generator().manual_seed(9)
    teacher_logits = 3 * torch.randn(N, V, generator=generator)
    teacher_logits[[1, 4]] = -math.inf
    teacher = kd.teacher_topk_from_logits(teacher_logits.to(DEVICE), k=K, temperature=TAU, vocab_size=VOCAB,
                                          backend=backend)
    student_logits = 3 * torch.randn(N, V, generator=generator)
    labels = torch.tensor([3, -100, 5, 8, 13, -100])  # row 1 padding and ignored, row 4 padding with a label
    options = dict(divergence="jsd", support=support, temperature=TAU, ce_weight=0.5, vocab_size=VOCAB, beta=0.3)
    leaf = student_logits.to(DEVICE).requires_grad_()
    loss = kd.topk_divergence_from_logits(leaf, teacher, labels.to(DEVICE), backend=backend, **options)
    (grad,) = torch.autograd.grad(loss, leaf)
    # float64 by parts: the rows with a teacher through the reference ("sum"), row 4's CE by hand
    rows = [0, 2, 3, 5]
    logits64 = student_logits.double().requires_grad_()
    parts = reference.topk_divergence_from_logits(
        logits64[rows], reference.teacher_topk_from_logits(teacher_logits[rows], K, TAU, VOCAB), labels[rows],
        DivergenceOptions(reduction="sum", **options))
    padding_ce = -torch.log_softmax(logits64[4, :VOCAB], -1)[13]
    expected = (parts + 0.5 * padding_ce) / 4  # 4 counted rows: 0, 2, 3 and 4
    (expected_grad,) = torch.autograd.grad(expected, logits64)
    assert relative_error(loss, expected) <= 1e-5
    assert relative_error(grad, expected_grad) <= 1e-5
    assert (grad[1] == 0).all()


def test_empty_teacher_rows_in_the_vocab_sharded_reference():
    logits = 3 * torch.randn(4, 40, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    logits[2] = -math.inf
    top = reference.teacher_topk_sharded(list(logits.split(20, dim=-1)), k=6)
    _check_empty_rows(top, [2])
    unsharded = reference.teacher_topk_from_logits(logits, 6)
    assert torch.equal(top.indices, unsharded.indices)
    assert torch.equal(top.logprobs.isneginf(), unsharded.logprobs.isneginf())


# ---- 5. bf16 under the Triton interpreter -----------------------------------------------------

@pytest.mark.skipif(not INTERPRETER, reason="the refusal is the interpreter's")
def test_bf16_teacher_topk_under_the_interpreter_is_refused():
    hidden, weight = torch.randn(4, 16).bfloat16(), torch.randn(40, 16).bfloat16()
    with pytest.raises(TypeError, match=r"hidden: bfloat16 on the triton backend under TRITON_INTERPRET=1 is refused "
                                        r".*pass float32 or float16 inputs, or backend='torch'"):
        kd.teacher_topk(hidden, weight, k=4, backend="triton")
    status = kd.available_backends()["triton"]
    assert status.startswith("available") and "bf16 teacher_topk refused" in status
    assert "before Python starts" in status
    # the torch backend takes bf16 (float64 inside)
    top = kd.teacher_topk(hidden, weight, k=4, backend="torch")
    assert torch.equal(top.indices, reference.teacher_topk(hidden, weight, 4).indices)


# ---- 6. out-of-range teacher ids with the value checks off ----------------------------------

def _out_of_range_teacher(teacher):
    """Ids V* (a padded column of the tensor), past the tensor's columns, negative, and one on an
    entry already invalid; returns it and the same teacher with those entries -inf."""
    logprobs, indices = teacher.logprobs.clone(), teacher.indices.clone()
    indices[0, 1], indices[1, 0], indices[2, 4], indices[3, 2] = VOCAB, V + 50, -3, VOCAB + 1
    logprobs[3, 2:] = -math.inf
    bad = (indices < 0) | (indices >= VOCAB)
    return (kd.TopK(logprobs, indices, teacher.lse, TAU),
            kd.TopK(torch.where(bad, -math.inf, logprobs), indices, teacher.lse, TAU))


@pytest.mark.parametrize("support", ["renormalized", "tail"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_ids_are_invalid_entries_when_unchecked(backend, support):
    teacher, _ = _teacher(11)
    unchecked, invalid = _out_of_range_teacher(teacher)
    logits = _student(11)
    labels = torch.tensor([1, 2, -100, 4, 5, 6]).to(DEVICE)
    upstream = torch.rand(N, generator=torch.Generator().manual_seed(12), dtype=torch.float64) + 0.5
    before = unchecked.logprobs.clone()
    for divergence in ("forward_kl", "reverse_kl"):
        options = dict(divergence=divergence, support=support, ce_weight=0.5)
        got, grad = _loss_and_grad(logits, unchecked, labels, backend, upstream, check_values=False, **options)
        expected, expected_grad = _loss_and_grad(logits.double(), invalid, labels, "torch", upstream, **options)
        _assert_no_nan(got, grad)
        assert relative_error(got, expected) <= 1e-5 and relative_error(grad, expected_grad) <= 1e-5
        assert (grad[:, VOCAB:] == 0).all()  # nothing lands on the padded columns
    assert torch.equal(unchecked.logprobs, before)  # the caller's teacher is not modified
    with pytest.raises(ValueError, match=r"teacher.indices: a valid entry lies outside \[0, 200\)"):
        kd.topk_divergence_from_logits(logits.to(DEVICE), unchecked, labels, temperature=TAU, vocab_size=VOCAB,
                                       backend=backend)


def test_out_of_range_ids_through_the_lm_head_when_unchecked():
    teacher, _ = _teacher(13)
    unchecked, invalid = _out_of_range_teacher(teacher)
    generator = torch.Generator().manual_seed(13)
    hidden, weight = torch.randn(N, 16, generator=generator), torch.randn(V, 16, generator=generator)
    results = []
    for top, dtype, backend, check in ((unchecked, torch.float32, "triton", False),
                                       (invalid, torch.float64, "torch", True)):
        leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (hidden, weight)]
        loss = kd.topk_divergence(*leaves, top, None, support="tail", temperature=TAU, vocab_size=VOCAB,
                                  backend=backend, check_values=check)
        results.append((loss, torch.autograd.grad(loss, leaves)))
    (loss, grads), (expected, expected_grads) = results
    assert relative_error(loss, expected) <= 1e-5
    for grad, expected_grad in zip(grads, expected_grads):
        assert relative_error(grad, expected_grad) <= 1e-5
    assert (grads[1][VOCAB:] == 0).all()


# ---- 4. float32 on the Triton backend ---------------------------------------------------------

def test_float32_on_the_triton_backend_never_reaches_the_epilogue_matmul(monkeypatch):
    """Natively the epilogue matmul refuses float32 (its float32 tiles need ~320 KiB of shared
    memory); every float32 schedule of the triton backend takes cuBLAS logits instead. Here the
    refusal is armed under the interpreter too."""
    from kd_kernels.ops import lm_head_group_maxima

    original = lm_head_group_maxima.EpilogueMatmul.__init__

    def refuse_float32(self, hidden, *args, **kwargs):
        assert hidden.dtype != torch.float32, "float32 reached the epilogue matmul"
        original(self, hidden, *args, **kwargs)

    monkeypatch.setattr(lm_head_group_maxima.EpilogueMatmul, "__init__", refuse_float32)
    generator = torch.Generator().manual_seed(14)
    hidden = torch.randn(N, 16, generator=generator).to(DEVICE)
    weight = torch.randn(V, 16, generator=generator).to(DEVICE)
    exact = reference.lm_head_logits(hidden, weight)
    for k, lean in ((8, False), (8, True), (100, False)):
        top = kd.teacher_topk(hidden, weight, k=k, temperature=TAU, vocab_size=VOCAB, backend="triton", lean=lean)
        check_teacher_topk(top, reference.teacher_topk(hidden, weight, k, TAU, VOCAB), 1e-5, exact, TAU, VOCAB)
    teacher, _ = _teacher(14)
    for lean in (False, True):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
        loss = kd.topk_divergence(*leaves, teacher, None, support="tail", temperature=TAU, vocab_size=VOCAB,
                                  backend="triton", lean=lean)
        leaves64 = [t.double().requires_grad_() for t in (hidden, weight)]
        expected = kd.topk_divergence(*leaves64, teacher, None, support="tail", temperature=TAU, vocab_size=VOCAB,
                                      backend="torch")
        assert relative_error(loss, expected) <= 1e-5
        for grad, expected_grad in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, leaves64)):
            assert relative_error(grad, expected_grad) <= 1e-5


# ---- native: real shapes on a GPU ---------------------------------------------------------------

GPU_ROWS, GPU_HIDDEN, GPU_V, GPU_VOCAB, GPU_K = 512, 4096, 151_936, 151_900, 64
HAS_CUDA_EXTENSION = kd.available_backends()["cuda"].startswith("available")
GPU_TEACHER_BACKENDS = ["triton", pytest.param("cuda", marks=[pytest.mark.cuda_ext, pytest.mark.skipif(
    not HAS_CUDA_EXTENSION, reason="the CUDA extension is not built")])]


def _gpu_logits(seed, dtype=torch.float32, rows=GPU_ROWS):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (4 * torch.randn(rows, GPU_V, device="cuda", generator=generator)).to(dtype)


def _gpu_masked_student(teacher, dtype):
    """A masked vocabulary: every 97th column -inf, and the teacher's 2nd id on even rows and its
    1st on every third; labels on columns that stay finite (or ignored)."""
    logits = _gpu_logits(2, torch.float32)
    logits[:, ::97] = -math.inf
    rows = torch.arange(GPU_ROWS, device="cuda")
    ids = teacher.indices.long()
    logits[rows[::2], ids[::2, 1]] = -math.inf
    logits[rows[::3], ids[::3, 0]] = -math.inf
    labels = torch.where(torch.isfinite(logits.gather(1, ids[:, 4:5])).squeeze(1), ids[:, 4], -100)
    labels[rows % 5 == 0] = -100
    return logits.to(dtype), labels


GPU_MASKED_CASES = ([(d, s, torch.float32, 1e-5) for d in DIVERGENCES for s in ("renormalized", "tail")]
                    + [("reverse_kl", "tail", torch.bfloat16, 2e-2), ("jsd", "renormalized", torch.bfloat16, 2e-2)])


@pytest.mark.gpu
@pytest.mark.parametrize("divergence, support, dtype, tolerance", GPU_MASKED_CASES)
def test_gpu_minus_inf_student_logits(divergence, support, dtype, tolerance):
    teacher = kd.teacher_topk_from_logits(_gpu_logits(1), k=GPU_K, temperature=TAU, vocab_size=GPU_VOCAB,
                                          backend="triton")
    logits, labels = _gpu_masked_student(teacher, dtype)
    upstream = torch.rand(GPU_ROWS, device="cuda", dtype=torch.float64) + 0.5
    options = dict(divergence=divergence, support=support, ce_weight=0.5, beta=0.3, skew_lambda=0.2,
                   vocab_size=GPU_VOCAB)
    got, grad = _loss_and_grad(logits, teacher, labels, "triton", upstream, **options)
    stand_in = torch.where(torch.isneginf(logits), FINITE_LIMIT, logits).double()
    limit, limit_grad = _loss_and_grad(stand_in, teacher, labels, "torch", upstream, **options)
    _assert_no_nan(got, grad)
    at_ids = torch.isneginf(logits.gather(1, teacher.indices.long())).cpu() & teacher.valid.cpu()
    infinite = at_ids.any(-1) & (labels != -100).cpu() & (divergence in ("forward_kl", "adaptive_kl"))
    assert torch.equal(torch.isposinf(got), infinite)
    assert relative_error(got[~infinite], limit[~infinite]) <= tolerance
    assert torch.isfinite(grad).all() and relative_error(grad, limit_grad) <= tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("lean", [False, True])
def test_gpu_minus_inf_bias_through_the_lm_head(monkeypatch, dtype, tolerance, lean):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    generator = torch.Generator(device="cuda").manual_seed(3)
    hidden = (0.2 * torch.randn(GPU_ROWS, GPU_HIDDEN, device="cuda", generator=generator)).to(dtype)
    weight = (0.02 * torch.randn(GPU_V, GPU_HIDDEN, device="cuda", generator=generator)).to(dtype)
    bias = torch.zeros(GPU_V, device="cuda")
    teacher = kd.teacher_topk_from_logits(_gpu_logits(4), k=GPU_K, temperature=TAU, vocab_size=GPU_VOCAB)
    bias[teacher.indices[::4, :3].long().flatten()] = -math.inf  # masked columns, many of them teacher ids
    bias[::501] = -math.inf
    labels = torch.where(torch.isfinite(bias[teacher.indices[:, 5].long()]), teacher.indices[:, 5].long(), -100)
    results = []
    for b, input_dtype, backend in ((bias.to(dtype), dtype, "triton"),
                                    (torch.where(torch.isneginf(bias), FINITE_LIMIT, bias), torch.float64, "torch")):
        leaves = [t.detach().to(input_dtype).requires_grad_() for t in (hidden, weight, b)]
        loss = kd.topk_divergence(leaves[0], leaves[1], teacher, labels, bias=leaves[2], divergence="reverse_kl",
                                  support="tail", temperature=TAU, ce_weight=0.5, vocab_size=GPU_VOCAB,
                                  backend=backend, **({"lean": lean} if backend == "triton" else {}))
        results.append((loss, torch.autograd.grad(loss, leaves)))
    (loss, grads), (limit, limit_grads) = results
    assert relative_error(loss, limit) <= tolerance
    for grad, limit_grad in zip(grads, limit_grads):
        _assert_no_nan(grad)
        assert relative_error(grad, limit_grad) <= tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_TEACHER_BACKENDS)
def test_gpu_zero_teacher_tail_and_empty_rows(backend):
    """A masked vocabulary of 40 finite columns a row (k = 64: missing entries, no tail bin) and
    padding rows of only -inf logits, through the GPU selection; then the student loss."""
    generator = torch.Generator(device="cuda").manual_seed(5)
    teacher_logits = torch.full((GPU_ROWS, GPU_V), -math.inf, device="cuda")
    finite = torch.rand(GPU_ROWS, GPU_V, device="cuda", generator=generator).argsort(-1)[:, :40]
    teacher_logits.scatter_(1, finite, 4 * torch.randn(GPU_ROWS, 40, device="cuda", generator=generator))
    padding = torch.arange(GPU_ROWS, device="cuda") % 7 == 3
    teacher_logits[padding] = -math.inf
    teacher = kd.teacher_topk_from_logits(teacher_logits, k=GPU_K, vocab_size=GPU_VOCAB, backend=backend)
    expected = reference.teacher_topk_from_logits(teacher_logits, GPU_K, vocab_size=GPU_VOCAB)
    assert torch.equal(teacher.valid, expected.valid) and torch.equal(teacher.indices, expected.indices.int())
    valid = expected.valid
    assert torch.allclose(teacher.logprobs.double()[valid], expected.logprobs[valid], atol=1e-5, rtol=0)
    _check_empty_rows(teacher, padding)
    student = _gpu_logits(6).requires_grad_()
    labels = torch.where(padding, -100, expected.indices[:, 0].long())
    loss = kd.topk_divergence_from_logits(student, teacher, labels, support="tail", divergence="reverse_kl",
                                          ce_weight=0.5, vocab_size=GPU_VOCAB, backend="triton")
    (grad,) = torch.autograd.grad(loss, student)
    # by hand, float64: the 40 bins of each counted row, no tail bin
    student64 = student.detach().double().requires_grad_()
    log_q = torch.log_softmax(student64[:, :GPU_VOCAB], -1)
    ids = torch.where(valid, expected.indices.long(), 0)
    p, q = torch.where(valid, expected.logprobs.exp(), 0.0), torch.where(valid, log_q.gather(1, ids).exp(), 0.0)
    kl = torch.where(valid, q * (q.clamp_min(1e-300) / p.clamp_min(1e-300)).log(), 0.0).sum(-1)
    counted = ~padding
    ce = -log_q.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1)
    expected_loss = torch.where(counted, kl + 0.5 * ce, 0.0).sum() / counted.sum()
    (expected_grad,) = torch.autograd.grad(expected_loss, student64)
    assert relative_error(loss, expected_loss) <= 1e-5 and relative_error(grad, expected_grad) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("k", [8, 64, 256])
@pytest.mark.parametrize("backend", GPU_TEACHER_BACKENDS)
def test_gpu_teacher_topk_with_minus_inf_bias(backend, k):
    """bf16 inputs take the epilogue-matmul schedules (maxima at k <= 64, appended past it): a
    bias that masks all but 40 columns (k = 64, 256: missing entries), then every column."""
    generator = torch.Generator(device="cuda").manual_seed(k)
    hidden = (0.2 * torch.randn(GPU_ROWS, GPU_HIDDEN, device="cuda", generator=generator)).bfloat16()
    weight = (0.02 * torch.randn(GPU_V, GPU_HIDDEN, device="cuda", generator=generator)).bfloat16()
    bias = torch.full((GPU_V,), -math.inf, device="cuda")
    bias[torch.randperm(GPU_VOCAB, device="cuda", generator=generator)[:40]] = 0.0
    top = kd.teacher_topk(hidden, weight, k=k, bias=bias.bfloat16(), vocab_size=GPU_VOCAB, backend=backend)
    exact = torch.log_softmax(reference.lm_head_logits(hidden, weight, bias.bfloat16())[:, :GPU_VOCAB], -1)
    expected = reference.teacher_topk_from_logits(exact, k)
    valid = expected.valid
    assert torch.equal(top.valid, valid) and (top.indices[~valid] == 0).all()
    assert torch.allclose(top.logprobs.double()[valid], expected.logprobs[valid], atol=1e-4, rtol=0)
    # an id may differ only where its exact log-prob is within 1e-4 of the reference's (a near tie)
    near = (exact.gather(1, top.indices.long()) - expected.logprobs).abs() <= 1e-4
    assert ((top.indices == expected.indices) | near)[valid].all()
    bias[:GPU_VOCAB] = -math.inf
    _check_empty_rows(kd.teacher_topk(hidden, weight, k=k, bias=bias.bfloat16(), vocab_size=GPU_VOCAB,
                                      backend=backend), slice(None))


@pytest.mark.gpu
def test_gpu_float32_on_the_triton_backend(monkeypatch):
    """float32 inputs on backend="triton": the teacher (default and lean schedules, from logits)
    and the student (fast and lean) against float64, TF32 off."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    generator = torch.Generator(device="cuda").manual_seed(7)
    hidden = 0.2 * torch.randn(GPU_ROWS, GPU_HIDDEN, device="cuda", generator=generator)
    weight = 0.02 * torch.randn(GPU_V, GPU_HIDDEN, device="cuda", generator=generator)
    exact = reference.lm_head_logits(hidden, weight)
    for k, lean in ((64, False), (64, True), (1024, False)):
        top = kd.teacher_topk(hidden, weight, k=k, temperature=TAU, vocab_size=GPU_VOCAB, backend="triton", lean=lean)
        check_teacher_topk(top, reference.teacher_topk_from_logits(exact, k, TAU, GPU_VOCAB), 1e-4, exact, TAU,
                           GPU_VOCAB)
    from_logits = kd.teacher_topk_from_logits(exact.float(), k=GPU_K, temperature=TAU, vocab_size=GPU_VOCAB,
                                              backend="triton")
    check_teacher_topk(from_logits, reference.teacher_topk_from_logits(exact, GPU_K, TAU, GPU_VOCAB), 1e-4, exact,
                       TAU, GPU_VOCAB)
    del exact
    teacher = kd.teacher_topk_from_logits(_gpu_logits(8), k=GPU_K, temperature=TAU, vocab_size=GPU_VOCAB)
    labels = teacher.indices[:, 3].long()
    options = dict(support="tail", divergence="jsd", temperature=TAU, ce_weight=0.5, vocab_size=GPU_VOCAB)
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight)]
    expected = kd.topk_divergence(*leaves64, teacher, labels, backend="torch", **options)
    expected_grads = torch.autograd.grad(expected, leaves64)
    for lean in (False, True):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
        loss = kd.topk_divergence(*leaves, teacher, labels, backend="triton", lean=lean, **options)
        assert relative_error(loss, expected) <= 1e-5
        for grad, expected_grad in zip(torch.autograd.grad(loss, leaves), expected_grads):
            assert relative_error(grad, expected_grad) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("support", ["renormalized", "tail"])
def test_gpu_out_of_range_ids_when_unchecked(monkeypatch, support):
    """Ids at V*, past the tensor, negative and at the int32 maximum read nothing (an illegal
    access would fail the launch) and count as invalid entries."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    teacher = kd.teacher_topk_from_logits(_gpu_logits(9), k=GPU_K, temperature=TAU, vocab_size=GPU_VOCAB)
    indices = teacher.indices.clone()
    indices[::3, 1], indices[1::3, 0], indices[2::3, 7] = GPU_VOCAB, GPU_V + 10_000, -5
    indices[::5, 9] = 2**31 - 1
    bad = (indices < 0) | (indices >= GPU_VOCAB)
    unchecked = kd.TopK(teacher.logprobs, indices, teacher.lse, TAU)
    invalid = kd.TopK(torch.where(bad, -math.inf, teacher.logprobs), indices, teacher.lse, TAU)
    logits = _gpu_logits(10)
    labels = teacher.indices[:, 2].long()
    upstream = torch.rand(GPU_ROWS, device="cuda", dtype=torch.float64) + 0.5
    options = dict(divergence="forward_kl", support=support, ce_weight=0.5, vocab_size=GPU_VOCAB)
    got, grad = _loss_and_grad(logits, unchecked, labels, "triton", upstream, check_values=False, **options)
    torch.cuda.synchronize()
    expected, expected_grad = _loss_and_grad(logits.double(), invalid, labels, "torch", upstream, **options)
    assert relative_error(got, expected) <= 1e-5 and relative_error(grad, expected_grad) <= 1e-5
    assert (grad[:, GPU_VOCAB:] == 0).all()
    generator = torch.Generator(device="cuda").manual_seed(11)
    hidden = 0.2 * torch.randn(GPU_ROWS, GPU_HIDDEN, device="cuda", generator=generator)
    weight = 0.02 * torch.randn(GPU_V, GPU_HIDDEN, device="cuda", generator=generator)
    results = []
    for top, dtype, backend, check in ((unchecked, torch.float32, "triton", False), (invalid, torch.float64, "torch",
                                                                                     True)):
        leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight)]
        loss = kd.topk_divergence(*leaves, top, labels, backend=backend, check_values=check, temperature=TAU,
                                  **options)
        results.append((loss, torch.autograd.grad(loss, leaves)))
    (loss, grads), (expected, expected_grads) = results
    assert relative_error(loss, expected) <= 1e-5
    for grad, expected_grad in zip(grads, expected_grads):
        assert relative_error(grad, expected_grad) <= 1e-5
