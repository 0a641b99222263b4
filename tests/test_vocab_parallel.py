"""Vocab parallel (``group=``) against the unsharded float64 reference, on CPU with gloo.

2 and 4 processes; V not divisible by the group (Megatron-padded shards, vocab_size < V);
ignored rows; every divergence and support mode on the torch backend, a subset on the
Triton backend (interpreter), both student schedules; the teacher's maxima and appended
schedules (16-bit inputs, two ranks); teacher TP ≠ student TP (four ranks).
"""
import os
import sys

import numpy
import pytest
import torch
import torch.distributed as dist

import kd_kernels as kd
from helpers import relative_error, spawn_ranks
from kd_kernels import reference
from kd_kernels.distributed import CollectiveBytes
from kd_kernels.options import DIVERGENCES

pytestmark = pytest.mark.interpret
N, H, V, VOCAB, K = 13, 8, 50, 47, 5
# the workers run the interpreter even where a GPU is: the Triton 3.6 interpreter fails on numpy >= 2.4
# (it makes ints of 1-element arrays), which the test extra keeps out and the GPU image has
NUMPY_BREAKS_INTERPRETER = tuple(int(part) for part in numpy.__version__.split(".")[:2]) >= (2, 4)


def _global_problem(world):
    generator = torch.Generator().manual_seed(1234)
    padded = -(-V // world) * world
    weight = torch.randn(padded, H, generator=generator)
    bias = torch.randn(padded, generator=generator)
    hidden = torch.randn(N, H, generator=generator)
    teacher_hidden = 2 * torch.randn(N, H, generator=generator)
    teacher_weight = torch.randn(padded, H, generator=generator)
    labels = torch.randint(0, VOCAB, (N,), generator=generator)
    labels[[1, 6]] = -100
    return hidden, weight, bias, teacher_hidden, teacher_weight, labels


def _shard(tensor, rank, world):
    local = tensor.shape[0] // world
    return tensor[rank * local:(rank + 1) * local]


def _check_teacher(rank, world, group, teacher_hidden, teacher_weight, backend):
    expected = reference.teacher_topk(teacher_hidden, teacher_weight, K, 2.0, VOCAB)
    got = kd.teacher_topk(teacher_hidden, _shard(teacher_weight, rank, world), k=K, temperature=2.0, vocab_size=VOCAB,
                          group=group, backend=backend)
    assert torch.equal(got.indices.long(), expected.indices.long()), (backend, rank)
    assert torch.allclose(got.logprobs.double(), expected.logprobs, atol=1e-5)
    logits = teacher_hidden.double() @ _shard(teacher_weight, rank, world).double().T
    got = kd.teacher_topk_from_logits(logits.float(), k=K, temperature=2.0, vocab_size=VOCAB, group=group,
                                      backend=backend)
    assert torch.equal(got.indices.long(), expected.indices.long())
    return got


def _check_teacher_no_logits_schedules(rank, world, group, teacher_hidden, teacher_weight):
    """16-bit inputs take the maxima schedule on each shard, and the appended one gives the same
    merge."""
    from kd_kernels.distributed import vocab_shard
    from kd_kernels.teacher.appended import teacher_topk_appended
    from kd_kernels.teacher.maxima import teacher_topk_maxima
    from kd_kernels.teacher.schedule import teacher_schedule

    hidden, weight = teacher_hidden.half(), teacher_weight.half()
    local = _shard(weight, rank, world)
    assert teacher_schedule(hidden, local, K) == "maxima"
    expected = reference.teacher_topk(hidden, weight, K, 2.0, VOCAB)
    shard = vocab_shard(group, local.shape[0], VOCAB)
    public = kd.teacher_topk(hidden, local, k=K, temperature=2.0, vocab_size=VOCAB, group=group, backend="triton")
    for name, got in (("public", public),
                      ("maxima", teacher_topk_maxima(hidden, local, K, 2.0, VOCAB, shard=shard)),
                      ("appended", teacher_topk_appended(hidden, local, K, 2.0, VOCAB, shard=shard))):
        assert torch.equal(got.indices.long(), expected.indices.long()), (rank, name)
        assert torch.allclose(got.logprobs.double(), expected.logprobs, atol=1e-5)
        assert torch.allclose(got.lse.double(), expected.lse, atol=1e-5)


def _check_student(rank, world, group, problem, teacher, backend, lean=False, **options):
    hidden, weight, bias, _, _, labels = problem
    kwargs = dict(temperature=2.0, ce_weight=0.5, vocab_size=VOCAB, beta=0.3, **options)
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    expected = kd.topk_divergence(leaves64[0], leaves64[1], teacher, labels, bias=leaves64[2], backend="torch",
                                  **kwargs)
    upstream = torch.linspace(0.5, 1.5, N, dtype=torch.float64) if expected.dim() else torch.tensor(1.3)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves64)
    dtype = torch.float64 if backend == "torch" else torch.float32
    local = [hidden.to(dtype).requires_grad_(), _shard(weight, rank, world).to(dtype).requires_grad_(),
             _shard(bias, rank, world).to(dtype).requires_grad_()]
    extra = dict(lean=lean) if backend == "triton" else {}
    got = kd.topk_divergence(local[0], local[1], teacher, labels, bias=local[2], group=group, backend=backend,
                             **kwargs, **extra)
    grads = torch.autograd.grad((got * upstream.to(got.dtype)).sum(), local)
    tolerance = 1e-10 if backend == "torch" else 1e-5
    assert relative_error(got, expected) <= tolerance, (backend, options)
    assert relative_error(grads[0], expected_grads[0]) <= tolerance, ("dX", backend, options)
    assert relative_error(grads[1], _shard(expected_grads[1], rank, world)) <= tolerance, ("dW", backend, options)
    assert relative_error(grads[2], _shard(expected_grads[2], rank, world)) <= tolerance, ("dB", backend, options)


def _check_student_from_logits(rank, world, group, problem, teacher, backend):
    hidden, weight, _, _, _, labels = problem
    full = (hidden.double() @ weight.double().T).requires_grad_()
    kwargs = dict(divergence="jsd", support="tail", temperature=2.0, ce_weight=0.5, vocab_size=VOCAB)
    expected = kd.topk_divergence_from_logits(full, teacher, labels, backend="torch", **kwargs)
    (expected_grad,) = torch.autograd.grad(expected, full)
    local = _shard(full.detach().T, rank, world).T.contiguous()
    local = local.float().requires_grad_() if backend == "triton" else local.requires_grad_()
    got = kd.topk_divergence_from_logits(local, teacher, labels, group=group, backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(got, local)
    assert relative_error(got, expected) <= 1e-5
    assert relative_error(grad, _shard(expected_grad.T, rank, world).T) <= 1e-5


def _check_bytes(rank, world, group, problem, teacher):
    hidden, weight, _, teacher_hidden, teacher_weight, labels = problem
    bound = N * (K * 8 * world + 64)
    with CollectiveBytes() as counter:
        kd.teacher_topk(teacher_hidden, _shard(teacher_weight, rank, world), k=K, temperature=2.0, vocab_size=VOCAB,
                        group=group, backend="triton")
    assert counter.total <= bound, ("teacher", counter.total, bound)
    with CollectiveBytes() as counter:  # forward only: the backward adds the dX all-reduce (N·H)
        with torch.no_grad():
            kd.topk_divergence(hidden, _shard(weight, rank, world), teacher, labels, temperature=2.0, ce_weight=0.5,
                               vocab_size=VOCAB, group=group, backend="triton", check_values=False)
    assert 0 < counter.total <= bound, ("student", counter.total, bound)


def _worker(rank, world, init_file):
    # CPU tensors through the Triton backend need the interpreter, also on a machine with CUDA;
    # it takes effect only if no kernel module has been imported in this process yet
    os.environ["TRITON_INTERPRET"] = "1"
    assert "kd_kernels.ops.row_statistics" not in sys.modules, "kernels defined before TRITON_INTERPRET was set"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        problem = _global_problem(world)
        teacher = None
        for backend in ("torch", "triton"):
            teacher = _check_teacher(rank, world, group, problem[3], problem[4], backend)
        for divergence in DIVERGENCES:
            for support in ("renormalized", "tail"):
                _check_student(rank, world, group, problem, teacher, "torch", divergence=divergence, support=support)
        # the Triton student on each schedule: both worlds; the rest of the interpreter's cases
        # (the same merges on shards of another size) on two ranks
        _check_student(rank, world, group, problem, teacher, "triton", divergence="jsd", support="tail")
        _check_student(rank, world, group, problem, teacher, "triton", lean=True, divergence="adaptive_kl",
                       support="tail")
        if world == 2:
            _check_teacher_no_logits_schedules(rank, world, group, problem[3], problem[4])
            for divergence, support, lean in (("forward_kl", "renormalized", False), ("tvd", "renormalized", True)):
                _check_student(rank, world, group, problem, teacher, "triton", lean=lean, divergence=divergence,
                               support=support)
            _check_student(rank, world, group, problem, teacher, "triton", divergence="reverse_kl", reduction="none",
                           support="tail")
        for backend in ("torch", "triton"):
            _check_student_from_logits(rank, world, group, problem, teacher, backend)
        _check_bytes(rank, world, group, problem, teacher)
        if world == 4:  # teacher sharded over pairs of ranks, student over all four
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            pair = pairs[rank // 2]
            teacher_pair = kd.teacher_topk(problem[3], _shard(problem[4], rank % 2, 2), k=K, temperature=2.0,
                                           vocab_size=VOCAB, group=pair, backend="triton")
            expected = reference.teacher_topk(problem[3], problem[4], K, 2.0, VOCAB)
            assert torch.equal(teacher_pair.indices.long(), expected.indices.long())
            _check_student(rank, world, group, problem, teacher_pair, "triton", divergence="forward_kl")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(NUMPY_BREAKS_INTERPRETER, reason=f"the Triton 3.6 interpreter fails on numpy "
                    f"{numpy.__version__} (>= 2.4); pyproject's test extra pins numpy<2.4")
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_unsharded_reference(world):
    spawn_ranks(_worker, world)


def _nccl_worker(rank, world, init_file):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        n, h, v, vocab, k = 4096, 2048, 151_936, 151_900, 64
        generator = torch.Generator(device="cuda").manual_seed(5)  # same on every rank
        weight = (torch.randn(v, h, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
        hidden = (torch.randn(n, h, device="cuda", generator=generator) * 0.3).to(torch.bfloat16)
        teacher_weight = (torch.randn(v, h, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
        labels = torch.randint(0, vocab, (n,), device="cuda", generator=generator)
        local = v // world
        shard = slice(rank * local, (rank + 1) * local)
        expected_teacher = kd.teacher_topk(hidden, teacher_weight, k=k, temperature=2.0, vocab_size=vocab)
        teacher = kd.teacher_topk(hidden, teacher_weight[shard], k=k, temperature=2.0, vocab_size=vocab, group=group)
        assert (teacher.indices == expected_teacher.indices).float().mean() > 0.999
        assert torch.allclose(teacher.logprobs, expected_teacher.logprobs, atol=1e-4)
        for lean in (False, True):
            kwargs = dict(divergence="jsd", support="tail", temperature=2.0, ce_weight=0.5, vocab_size=vocab, lean=lean)
            leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
            expected = kd.topk_divergence(leaves[0], leaves[1], expected_teacher, labels, **kwargs)
            expected_grads = torch.autograd.grad(expected, leaves)
            sharded = [hidden.clone().requires_grad_(), weight[shard].clone().requires_grad_()]
            got = kd.topk_divergence(sharded[0], sharded[1], expected_teacher, labels, group=group, **kwargs)
            grads = torch.autograd.grad(got, sharded)
            assert relative_error(got, expected) <= 1e-5
            assert relative_error(grads[0], expected_grads[0]) <= 1e-2  # bf16 sums in another order
            assert relative_error(grads[1], expected_grads[1][shard]) <= 1e-2
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_nccl_two_ranks_match_one():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    spawn_ranks(_nccl_worker, 2)
