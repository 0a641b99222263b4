"""Trainer → rollout weight sync: bucket plans, packing, the receiver's guards, the sync over a
stateless gloo group between a trainer that has its own data-parallel group and a rollout worker
(3 processes), the trainer's pushes into a rollout's shared buffer (one process and two); CUDA
IPC and NCCL on GPUs."""
import multiprocessing

import pytest
import torch

from helpers import HAS_CUDA, cpu_ranks, free_port, spawn_ranks, tiny_llama
from orchestration.flat_parameters import ELEMENT_ALIGNMENT, flat_offsets, flat_region, flatten_parameters
from orchestration.rollout import RolloutWorker
from orchestration.weight_source import WeightSource
from orchestration.weight_sync import (ALIGNMENT, MappedTensors, WeightPusher, WeightSender, as_dtype, bucket_layout,
                                       bucket_views, pack_bucket, plan_buckets)

TOKENS = torch.tensor([[3, 17, 42, 5, 88, 1, 9, 60]])


def _specs(model):
    return [(name, parameter.dtype, tuple(parameter.shape)) for name, parameter in model.named_parameters()]


def _perturb(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator).to(parameter.device) * 0.01)


# ---- bucket plans and packing --------------------------------------------------------------

@pytest.mark.parametrize("size", ["smaller_than_any_parameter", "between", "whole_model"])
def test_buckets_hold_every_parameter_once_in_order(size):
    specs = _specs(tiny_llama(0))
    sizes = [torch.empty(shape, dtype=dtype).nbytes for _, dtype, shape in specs]
    model_bytes = bucket_layout([d for _, d, _ in specs], [s for _, _, s in specs])[1]
    bucket_bytes = {"smaller_than_any_parameter": min(sizes) - 1, "between": model_bytes // 5,
                    "whole_model": model_bytes}[size]
    buckets = plan_buckets(specs, bucket_bytes)
    assert [name for bucket in buckets for name in bucket.names] == [name for name, _, _ in specs]
    assert [(d, s) for b in buckets for d, s in zip(b.dtypes, b.shapes)] == [(d, s) for _, d, s in specs]
    for bucket in buckets:
        assert bucket.nbytes <= bucket_bytes or len(bucket.names) == 1
    for before, after in zip(buckets, buckets[1:]):  # greedy: the next tensor did not fit
        assert bucket_layout(before.dtypes + after.dtypes[:1], before.shapes + after.shapes[:1])[1] > bucket_bytes
    if size == "smaller_than_any_parameter":
        assert len(buckets) == len(specs)
    elif size == "whole_model":
        assert len(buckets) == 1 and buckets[0].nbytes == model_bytes
    else:
        assert 1 < len(buckets) < len(specs)


def test_bucket_plan_refuses_bad_input():
    with pytest.raises(ValueError, match="bucket_bytes: expected an int >= 1, got 0"):
        plan_buckets([("a", torch.float32, (2,))], 0)
    with pytest.raises(ValueError, match="'a' appears twice"):
        plan_buckets([("a", torch.float32, (2,)), ("a", torch.float32, (2,))], 100)
    with pytest.raises(ValueError, match="dtype: expected a torch.dtype or its name, got 'float33'"):
        plan_buckets([("a", "float33", (2,))], 100)
    assert as_dtype("torch.bfloat16") is torch.bfloat16 and as_dtype("int64") is torch.int64


def test_packing_mixed_dtypes_round_trips_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=generator), "h": torch.randn(7, generator=generator).bfloat16(),
               "i": torch.randint(-9, 9, (3,), generator=generator), "b": torch.tensor([True, False, True]),
               "s": torch.tensor(2.5, dtype=torch.float64), "e": torch.randn(0, 4, generator=generator)}
    (bucket,) = plan_buckets([(n, t.dtype, t.shape) for n, t in tensors.items()], 10_000)
    ends = [0]
    for offset, dtype, shape in zip(bucket.offsets, bucket.dtypes, bucket.shapes):
        assert offset % ALIGNMENT == 0 and ends[-1] <= offset < ends[-1] + ALIGNMENT
        ends.append(offset + torch.empty(shape, dtype=dtype).nbytes)
    assert bucket.nbytes == ends[-1]
    buffer = pack_bucket(bucket, list(tensors.values()))
    for (name, tensor), view in zip(tensors.items(), bucket_views(buffer, bucket)):
        assert view.dtype == tensor.dtype and torch.equal(view, tensor), name
    with pytest.raises(ValueError, match="'w' has shape \\(5, 3\\), the bucket expects \\(3, 5\\)"):
        pack_bucket(bucket, [tensors["w"].t()] + list(tensors.values())[1:])


# ---- the receiver in one process ---------------------------------------------------------

def _update_in_process(sender, worker, weight_version, buckets=slice(None)):
    """The buckets of ``sender`` (all, or a slice of them) packed and handed to ``worker``."""
    for index in range(len(sender.buckets))[buckets]:
        bucket = sender.buckets[index]
        worker.update_weights_from_tensor(bucket.names, [str(d) for d in bucket.dtypes], bucket.shapes,
                                          sender.pack(index), weight_version)


def test_an_update_makes_the_logits_equal_bit_for_bit():
    trainer, worker = tiny_llama(1), RolloutWorker(tiny_llama(2), pad_token_id=0)
    sender = WeightSender(trainer, bucket_bytes=4096)
    assert len(sender.buckets) > 3
    assert not torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    worker.pause_generation()
    assert worker.flush_cache()
    _update_in_process(sender, worker, 1)
    metrics = worker.continue_generation()
    assert torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    assert metrics["weight_version"] == worker.weight_version == 1
    assert metrics["buckets"] == len(sender.buckets) and metrics["bytes"] == sum(b.nbytes for b in sender.buckets)


def test_sending_in_bfloat16_rounds_each_parameter_once():
    trainer, worker = tiny_llama(1), RolloutWorker(tiny_llama(2), pad_token_id=0)
    sender = WeightSender(trainer, bucket_bytes=1 << 20, dtype=torch.bfloat16)
    assert set(dtype for bucket in sender.buckets for dtype in bucket.dtypes) == {torch.bfloat16}
    worker.pause_generation()
    _update_in_process(sender, worker, 1)
    worker.continue_generation()
    for (name, mine), theirs in zip(worker.model.named_parameters(), trainer.parameters()):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs.bfloat16().float()), name


def test_the_receiver_refuses_unsafe_updates():
    trainer, worker = tiny_llama(1), RolloutWorker(tiny_llama(2), pad_token_id=0)
    sender = WeightSender(trainer, bucket_bytes=4096)
    with pytest.raises(RuntimeError, match="call pause_generation before updating weights"):
        _update_in_process(sender, worker, 1, buckets=slice(1))
    worker.pause_generation()
    _update_in_process(sender, worker, 1, buckets=slice(2))
    with pytest.raises(RuntimeError, match="two updates may not interleave"):
        _update_in_process(sender, worker, 2, buckets=slice(1))
    with pytest.raises(ValueError, match="came twice in the update to weight_version 1"):
        _update_in_process(sender, worker, 1, buckets=slice(1))
    with pytest.raises(RuntimeError, match="update to weight_version 1 is incomplete: .* the worker stays paused"):
        worker.continue_generation()
    assert worker._receiver.paused and worker.weight_version == 0
    with pytest.raises(ValueError, match="'lm_head.weight' is \\(1, 1\\) in the update, \\(96, 32\\) here"):
        worker.update_weights_from_tensor(["lm_head.weight"], ["float32"], [(1, 1)], torch.empty(4, dtype=torch.uint8),
                                          1)
    with pytest.raises(ValueError, match="'nope' is not a parameter of this model"):
        worker.update_weights_from_tensor(["nope"], ["float32"], [(1,)], torch.empty(4, dtype=torch.uint8), 1)
    _update_in_process(sender, worker, 1, buckets=slice(2, None))  # the other buckets complete it
    worker.continue_generation()
    assert worker.weight_version == 1 and torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    worker.pause_generation()
    with pytest.raises(ValueError, match="weight_version: expected an int > 1 \\(this worker's\\), got 1"):
        _update_in_process(sender, worker, 1, buckets=slice(1))


def test_the_sender_refuses_versions_that_do_not_increase():
    sender = WeightSender(tiny_llama(1), bucket_bytes=4096)
    with pytest.raises(RuntimeError, match="send: call init_group first"):
        sender.send(1)
    with pytest.raises(ValueError, match="weight_version: expected an int > 0 \\(the last one sent\\), got 0"):
        sender._next_version(0)


# ---- over a stateless gloo group, 3 processes ---------------------------------------------

GROUP = "weights"


def _trainer_and_rollout(rank, world, init_file, port, queue):
    """Ranks 0 and 1: the student's data-parallel group (their default group); rank 0 also sends
    the weights to rank 2, a rollout worker outside that group."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked rank (`cpu_ranks`)
    if rank < 2:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        model = tiny_llama(1)
        if rank == 0:
            sender = WeightSender(model, bucket_bytes=4096)
            queue.put([(b.names, b.dtypes, b.shapes) for b in sender.buckets])
            sender.init_group("127.0.0.1", port, 2, GROUP, "gloo")
        for version in (1, 2):
            # a "step": the ranks agree on an update through their own group, which stays usable
            update = torch.full((1,), float(rank + version))
            dist.all_reduce(update)
            _perturb(model, int(update.item()))
            if rank == 0:
                metrics = sender.send(version)
                assert (metrics.weight_version, metrics.buckets) == (version, len(sender.buckets))
                assert metrics.bytes == sum(b.nbytes for b in sender.buckets) and metrics.gb_per_s > 0
                with torch.no_grad():
                    queue.put(model(TOKENS).logits)
        if rank == 0:
            sender.destroy_group()
        dist.barrier()
        dist.destroy_process_group()
        return
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    plan = queue.get()
    worker.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
    for version in (1, 2):
        worker.pause_generation()
        worker.flush_cache()
        for names, dtypes, shapes in plan:
            worker.update_weights_from_distributed(names, dtypes, shapes, GROUP, version)
        metrics = worker.continue_generation()
        assert metrics["weight_version"] == version and metrics["buckets"] == len(plan)
        expected = queue.get()
        with torch.no_grad():
            assert torch.equal(worker.model(TOKENS).logits, expected)
        assert worker.generate([[1, 2, 3]]).weight_version == version
    worker.destroy_weights_update_group(GROUP)


def test_sync_over_a_stateless_gloo_group_beside_the_trainers_own_group():
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    cpu_ranks(_trainer_and_rollout, 3, free_port(), queue)


# ---- GPUs ---------------------------------------------------------------------------------

def _ipc_sender(rank, world, init_file, queue, acks):
    if rank == 0:
        model = tiny_llama(1, vocab=32_000, hidden=512).cuda()
        sender = WeightSender(model, bucket_bytes=8 << 20, dtype=torch.bfloat16)
        queue.put(len(sender.buckets))
        for index in range(len(sender.buckets)):
            queue.put(sender.share(index, 1))
            acks.get()
            metrics = sender.release_shared()
        assert metrics.weight_version == 1 and metrics.bytes == sum(b.nbytes for b in sender.buckets)
        with torch.no_grad():
            queue.put(model.to(torch.bfloat16)(TOKENS.cuda()).logits.cpu())
        acks.get()
        return
    worker = RolloutWorker(tiny_llama(2, vocab=32_000, hidden=512), pad_token_id=0, device="cuda",
                           dtype=torch.bfloat16)
    worker.pause_generation()
    for _ in range(queue.get()):
        names, dtypes, shapes, handle, version = queue.get()
        worker.update_weights_from_tensor(names, dtypes, shapes, handle, version)
        acks.put(True)
    worker.continue_generation()
    expected = queue.get()
    with torch.no_grad():
        assert torch.equal(worker.model(TOKENS.cuda()).logits.cpu(), expected)
    acks.put(True)


@pytest.mark.gpu
def test_cuda_ipc_sync_on_one_gpu_gives_bit_equal_logits():
    context = multiprocessing.get_context("spawn")
    spawn_ranks(_ipc_sender, 2, context.SimpleQueue(), context.SimpleQueue())


def _nccl_ranks(rank, world, init_file, port, queue):
    torch.cuda.set_device(rank)
    if rank == 0:
        model = tiny_llama(1, vocab=32_000, hidden=512).cuda()
        sender = WeightSender(model, bucket_bytes=8 << 20)
        queue.put([(b.names, b.dtypes, b.shapes) for b in sender.buckets])
        sender.init_group("127.0.0.1", port, 2, GROUP, "nccl")
        sender.send(1)
        queue.put({name: parameter.detach().cpu() for name, parameter in model.named_parameters()})
        queue.get()  # the receiver has compared
        sender.destroy_group()
        return
    worker = RolloutWorker(tiny_llama(2, vocab=32_000, hidden=512), pad_token_id=0, device="cuda:1")
    plan = queue.get()
    worker.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "nccl")
    worker.pause_generation()
    for names, dtypes, shapes in plan:
        worker.update_weights_from_distributed(names, dtypes, shapes, GROUP, 1)
    worker.continue_generation()
    expected = queue.get()  # parameters, not logits: two GPUs need not compute bit-equal logits
    for name, parameter in worker.model.named_parameters():
        assert torch.equal(parameter.cpu(), expected[name]), name
    queue.put(True)
    worker.destroy_weights_update_group(GROUP)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_sync_across_two_gpus_gives_bit_equal_parameters():
    spawn_ranks(_nccl_ranks, 2, free_port(), multiprocessing.get_context("spawn").SimpleQueue())


def _mapped(tensor):
    return tensor


def test_a_payload_of_one_handle_per_tensor_updates_the_whole_model_in_one_call():
    """The colocated path's payload shape (`WeightSender.share_tensors`: one ``(rebuild, args)``
    per tensor, here rebuilding to the trainer's own tensors on CPU): one call covers the model,
    its bytes are the tensors' own, and a tensor of another dtype than announced is refused."""
    trainer, worker = tiny_llama(1), RolloutWorker(tiny_llama(2), pad_token_id=0)
    named = list(trainer.named_parameters())
    names, dtypes, shapes = [n for n, _ in named], [p.dtype for _, p in named], [tuple(p.shape) for _, p in named]
    worker.pause_generation()
    wrong = [(_mapped, (p.detach().double(),)) for _, p in named]
    with pytest.raises(ValueError, match=f"payload: '{names[0]}' is torch.float64 .* the update says torch.float32"):
        worker.update_weights_from_tensor(names, dtypes, shapes, wrong, 1)
    with pytest.raises(ValueError, match=f"payload: expected {len(names)} tensor handles, got 1"):
        worker.update_weights_from_tensor(names, dtypes, shapes, wrong[:1], 1)
    reply = worker.update_weights_from_tensor(names, dtypes, shapes, [(_mapped, (p.detach(),)) for _, p in named], 1)
    metrics = worker.continue_generation()
    assert reply["bytes"] == metrics["bytes"] == sum(p.numel() * p.element_size() for _, p in named)
    assert metrics["buckets"] == 1 and worker.weight_version == 1
    assert torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    # the next update names the mapped tensors again: the trainer's new values arrive without new handles
    with torch.no_grad():
        for _, parameter in named:
            parameter.add_(0.01)
    worker.pause_generation()
    with pytest.raises(ValueError, match=r"payload: MappedTensors\(count=1, handed_at=1\) needs the 1 tensors of "
                                         r"the list payload of weight_version 1 mapped here; this worker "
                                         rf"holds {len(names)}"):
        worker.update_weights_from_tensor(names, dtypes, shapes, MappedTensors(1, 1), 2)
    with pytest.raises(ValueError, match=rf"holds {len(names)} of weight_version 1"):  # handles of another update
        worker.update_weights_from_tensor(names, dtypes, shapes, MappedTensors(len(names), 7), 2)
    worker.update_weights_from_tensor(names, dtypes, shapes, MappedTensors(len(names), 1), 2)
    worker.continue_generation()
    assert worker.weight_version == 2 and torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    # without the metadata: the layout checked when the tensors were mapped
    with torch.no_grad():
        for _, parameter in named:
            parameter.add_(0.01)
    worker.pause_generation()
    with pytest.raises(ValueError, match="names, dtypes, shapes: None only with a MappedTensors payload"):
        worker.update_weights_from_tensor(None, None, None, [(_mapped, (p.detach(),)) for _, p in named], 3)
    worker.update_weights_from_tensor(None, None, None, MappedTensors(len(names), 1), 3)
    worker.continue_generation()
    assert worker.weight_version == 3 and torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)


def _ipc_storages(rank, world, init_file, queue, acks):
    if rank == 0:
        model = tiny_llama(1, vocab=32_000, hidden=512).cuda()
        sender = WeightSender(model, bucket_bytes=8 << 20)
        for version in (1, 2):
            arguments = sender.share_tensors(version)
            if version == 2:  # the same storages: a marker of the handles sent at 1, no metadata
                assert arguments[:4] == (None, None, None, MappedTensors(len(list(model.parameters())), 1))
            queue.put(arguments)
            acks.get()
            metrics = sender.release_shared()
            assert metrics.weight_version == version
            assert metrics.bytes == sum(p.numel() * p.element_size() for p in model.parameters())
            with torch.no_grad():
                queue.put(model(TOKENS.cuda()).logits.cpu())
            acks.get()
            with torch.no_grad():  # in place: the same storages, so the same handles, hold the new weights
                for parameter in model.parameters():
                    parameter.mul_(1.0 + 0.01 * version)
        return
    worker = RolloutWorker(tiny_llama(2, vocab=32_000, hidden=512), pad_token_id=0, device="cuda")
    for version in (1, 2):
        if version == 1:
            worker.pause_generation()
            worker.update_weights_from_tensor(*queue.get())
            worker.continue_generation()
        else:  # the driver's call: pause -> copy -> continue in one
            assert worker.update_weights_from_tensor(*queue.get(), True)["weight_version"] == 2
        acks.put(True)
        expected = queue.get()
        with torch.no_grad():
            assert torch.equal(worker.model(TOKENS.cuda()).logits.cpu(), expected)
        acks.put(True)


@pytest.mark.gpu
def test_cuda_ipc_of_the_parameters_storages_gives_bit_equal_logits_update_after_update():
    context = multiprocessing.get_context("spawn")
    spawn_ranks(_ipc_storages, 2, context.SimpleQueue(), context.SimpleQueue())


# ---- flattened parameters: a whole-model update in one copy -----------------------------------

class _CopyCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the copy kernels (``copy_`` and ``_foreach_copy_``) run under it."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten._foreach_copy_):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_flattening_keeps_values_and_parameter_objects_and_trains():
    model, reference = tiny_llama(1), tiny_llama(1)
    before = {name: parameter for name, parameter in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    buffer = flatten_parameters(model)
    offsets, total = flat_offsets([p.numel() for p in before.values()])
    assert buffer.numel() == total and all(offset % ELEMENT_ALIGNMENT == 0 for offset in offsets)
    for (name, parameter), offset in zip(model.named_parameters(), offsets):
        assert parameter is before[name]  # the optimizer's references still hold
        assert parameter.data_ptr() == buffer[offset:].data_ptr()
    assert torch.equal(model(TOKENS).logits, reference(TOKENS).logits)
    for net, opt in ((model, optimizer), (reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))):
        net(TOKENS).logits.square().mean().backward()
        opt.step()
    assert torch.equal(model(TOKENS).logits, reference(TOKENS).logits)
    assert flat_region([p.detach() for p in model.parameters()]).data_ptr() == buffer.data_ptr()


def test_flat_region_refuses_tensors_out_of_the_layout():
    buffer = torch.zeros(3 * ELEMENT_ALIGNMENT)
    a, b = buffer[:10], buffer[ELEMENT_ALIGNMENT:ELEMENT_ALIGNMENT + 5]
    assert flat_region([a, b]).numel() == ELEMENT_ALIGNMENT + 5
    assert flat_region([b, a]) is None  # order
    assert flat_region([a, buffer[ELEMENT_ALIGNMENT + 1:ELEMENT_ALIGNMENT + 6]]) is None  # offset
    assert flat_region([a, torch.zeros(5)]) is None  # another storage
    with pytest.raises(ValueError, match="module: expected parameters of one dtype"):
        flatten_parameters(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double()))
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=rf"into: expected a 1-D torch.float32 tensor of {ELEMENT_ALIGNMENT + 2} "
                                         r"elements on cpu, got torch.float32 \(3,\) on cpu"):
        flatten_parameters(linear, into=torch.zeros(3))
    into = torch.full((ELEMENT_ALIGNMENT + 2,), 7.0)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    assert flatten_parameters(linear, into=into) is into
    assert torch.equal(into[:4].view(2, 2), weight) and torch.equal(into[ELEMENT_ALIGNMENT:], bias)
    assert linear.weight.data_ptr() == into.data_ptr()
    assert torch.equal(into[4:ELEMENT_ALIGNMENT], torch.full((ELEMENT_ALIGNMENT - 4,), 7.0))  # padding untouched


def test_a_flattened_trainer_updates_a_flattened_rollout_copy_in_one_cast_copy():
    """float32 trainer → bfloat16 rollout copy, both flattened: the update is one copy (with the
    cast) and gives the parameters a per-tensor cast would."""
    trainer = tiny_llama(1)
    flatten_parameters(trainer)
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0, dtype=torch.bfloat16)
    named = list(trainer.named_parameters())
    names, shapes = [n for n, _ in named], [tuple(p.shape) for _, p in named]
    dtypes = [p.dtype for _, p in named]
    for version, payload in ((1, [(_mapped, (p.detach(),)) for _, p in named]), (2, MappedTensors(len(named), 1))):
        with torch.no_grad():
            for _, parameter in named:
                parameter.mul_(1.0 + 0.1 * version)
        worker.pause_generation()
        with _CopyCount() as counted:
            worker.update_weights_from_tensor(names, dtypes, shapes, payload, version)
        worker.continue_generation()
        assert counted.copies == 1
        for name, parameter in worker.model.named_parameters():
            assert parameter.dtype == torch.bfloat16
            assert torch.equal(parameter, dict(named)[name].detach().to(torch.bfloat16)), name


def test_a_whole_update_in_one_call_gives_bit_equal_logits_and_refuses_without_touching_the_model():
    """`update_weights_from_tensor(..., whole_update=True)`: pause -> copy -> continue in one call
    (one copy when both models are flattened), then the metadata-free marker; a refused payload
    (wrong version, stale handles, a changed layout) leaves the worker unpaused on its weights."""
    trainer = tiny_llama(1)
    flatten_parameters(trainer)
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    named = list(trainer.named_parameters())
    names, dtypes, shapes = [n for n, _ in named], [p.dtype for _, p in named], [tuple(p.shape) for _, p in named]
    handles = [(_mapped, (p.detach(),)) for _, p in named]
    metrics = worker.update_weights_from_tensor(names, dtypes, shapes, handles, 1, True)
    assert metrics["weight_version"] == worker.weight_version == 1 and not worker._receiver.paused
    assert metrics["bytes"] == sum(p.numel() * p.element_size() for _, p in named) and metrics["buckets"] == 1
    assert torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    _perturb(trainer, 3)
    with _CopyCount() as counted:
        worker.update_weights_from_tensor(None, None, None, MappedTensors(len(names), 1), 2, True)
    assert counted.copies == 1 and worker.weight_version == 2
    assert torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    logits = worker.model(TOKENS).logits
    _perturb(trainer, 4)
    with pytest.raises(ValueError, match="weight_version: expected an int > 2"):
        worker.update_weights_from_tensor(None, None, None, MappedTensors(len(names), 1), 2, True)
    with pytest.raises(ValueError, match="holds .* of weight_version 1"):
        worker.update_weights_from_tensor(None, None, None, MappedTensors(len(names), 2), 3, True)
    changed = [(_mapped, (p.detach().reshape(-1),)) for _, p in named]  # a changed layout is checked again
    with pytest.raises(ValueError, match=f"payload: '{names[0]}' is torch.float32 "):
        worker.update_weights_from_tensor(names, dtypes, shapes, changed, 3, True)
    with pytest.raises(ValueError, match="holds .* of weight_version 1"):  # the refused handles were not kept
        worker.update_weights_from_tensor(None, None, None, MappedTensors(len(names), 3), 3, True)
    assert not worker._receiver.paused and worker.weight_version == 2
    assert torch.equal(worker.model(TOKENS).logits, logits)
    worker.update_weights_from_tensor(None, None, None, MappedTensors(len(names), 1), 3, True)  # still mapped
    assert worker.weight_version == 3 and torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    _perturb(trainer, 5)
    worker.pause_generation()
    with pytest.raises(RuntimeError, match="receive_whole: the worker is paused"):
        worker.update_weights_from_tensor(names, dtypes, shapes, handles, 4, True)
    worker.continue_generation()
    with pytest.raises(ValueError, match="whole_update: expected a bool, got 1"):
        worker.update_weights_from_tensor(names, dtypes, shapes, handles, 4, 1)
    worker.update_weights_from_tensor(names, dtypes, shapes, handles, 4, True)
    assert worker.weight_version == 4 and torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
    # a payload that misses parameters: written, so the worker stays paused until the rest arrives
    with pytest.raises(RuntimeError, match="resume: the update to weight_version 5 is incomplete"):
        worker.update_weights_from_tensor(names[:1], dtypes[:1], shapes[:1], handles[:1], 5, True)
    assert worker._receiver.paused and worker.weight_version == 4
    worker.update_weights_from_tensor(names[1:], dtypes[1:], shapes[1:], handles[1:], 5)
    assert worker.continue_generation()["weight_version"] == worker.weight_version == 5


# ---- the trainer pushes into a rollout worker's shared buffer ----------------------------------

class _Trainer(WeightSource):
    def __init__(self, model):
        self.model = model


def test_a_push_makes_the_rollout_equal_to_the_trainer_in_one_process():
    """A flattened float32 trainer into a float32 rollout copy (logits bit for bit) and into a
    bfloat16 one (its parameters the trainer's ``.to(bfloat16)``), one copy each; a trainer that is
    not flattened, a copy a tensor. The version a push publishes is the next generation's."""
    flat = tiny_llama(1)
    flatten_parameters(flat)
    unflattened = tiny_llama(3)
    for trainer, dtype, copies in ((flat, None, 1), (flat, torch.bfloat16, 1), (unflattened, None, 1)):
        worker = RolloutWorker(tiny_llama(2), pad_token_id=0, dtype=dtype)
        source = _Trainer(trainer)
        with pytest.raises(RuntimeError, match="push_weights: call map_rollout_weights first"):
            source.push_weights(1)
        source.map_rollout_weights(worker.share_weight_buffer())
        assert worker.share_weight_buffer() is worker.share_weight_buffer()  # shared once
        for version in (1, 2):
            _perturb(trainer, version)
            with _CopyCount() as counted:
                metrics = source.push_weights(version)
            assert counted.copies == copies  # one copy_, or one _foreach_copy_ of every tensor
            assert metrics["weight_version"] == worker.weight_version == version and metrics["buckets"] == 1
            assert metrics["bytes"] == sum(p.numel() * p.element_size() for p in worker.model.parameters())
            assert metrics["seconds"] > 0 and "lock_wait_seconds" in metrics
            for (name, mine), theirs in zip(worker.model.named_parameters(), trainer.parameters()):
                assert torch.equal(mine, theirs.detach().to(mine.dtype)), name
            if dtype is None:
                assert torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)
            assert worker.generate([[1, 2, 3]]).weight_version == version
        with pytest.raises(ValueError, match="weight_version: expected an int > 2 \\(the rollout worker's\\), got 2"):
            source.push_weights(2)
        with pytest.raises(ValueError, match="weight_version: expected an int > 2 \\(the rollout worker's\\), got True"):
            source.push_weights(True)
    # a flat trainer whose middle parameter was rebound since the mapping: refused, not pushed stale
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    source = _Trainer(flat)
    source.map_rollout_weights(worker.share_weight_buffer())
    middle = list(flat.parameters())[len(list(flat.parameters())) // 2]
    middle.data = middle.data.clone()
    with pytest.raises(RuntimeError, match="source: a parameter no longer lies where it did in the flat buffer"):
        source.push_weights(1)
    assert worker.weight_version == 0


def test_a_push_is_refused_on_another_layout_naming_the_parameter():
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    shared = worker.share_weight_buffer()
    other = tiny_llama(1, hidden=64)
    with pytest.raises(ValueError, match=r"shared: 'model.embed_tokens.weight' is \(96, 64\) here, \(96, 32\) in the "
                                         r"rollout worker"):
        WeightPusher(other, shared)
    renamed = [(f"x.{name}", tensor) for name, tensor in tiny_llama(1).named_parameters()]
    with pytest.raises(ValueError, match="shared: tensor 0 is 'x.model.embed_tokens.weight' here, "
                                         "'model.embed_tokens.weight' in the rollout worker"):
        WeightPusher(lambda: renamed, shared)
    with pytest.raises(ValueError, match=f"shared: {len(renamed) - 1} tensors here, {len(renamed)} in the rollout"):
        WeightPusher(lambda: list(tiny_llama(1).named_parameters())[:-1], shared)
    with pytest.raises(RuntimeError, match="share_buffer: the model's parameters are not one flat buffer"):
        mixed = tiny_llama(2)
        mixed.lm_head.to(torch.float64)
        RolloutWorker(mixed, pad_token_id=0).share_weight_buffer()


def _pushes_across_processes(rank, world, init_file, queue, answers, device="cpu"):
    """Rank 0: a rollout worker (bfloat16 on the second round) sharing its buffer; rank 1: the
    flattened float32 trainer pushing into it twice a round."""
    torch.set_num_threads(1)
    for dtype in (None, torch.bfloat16):
        if rank == 0:
            worker = RolloutWorker(tiny_llama(2), pad_token_id=0, dtype=dtype, device=device)
            queue.put(worker.share_weight_buffer())
            for version in (1, 2):
                expected = answers.get()
                assert worker.generate([[1, 2, 3]]).weight_version == worker.weight_version == version
                for name, parameter in worker.model.named_parameters():
                    assert torch.equal(parameter.cpu(), expected[name].to(parameter.dtype)), name
                if dtype is None:
                    with torch.no_grad():
                        assert torch.equal(worker.model(TOKENS.to(device)).logits.cpu(), expected["logits"])
                queue.put(True)
            continue
        trainer = _Trainer(tiny_llama(1).to(device))
        flatten_parameters(trainer.model)
        trainer.map_rollout_weights(queue.get())
        for version in (1, 2):
            _perturb(trainer.model, version)
            assert trainer.push_weights(version)["weight_version"] == version
            with torch.no_grad():
                answers.put({**{name: p.detach().cpu() for name, p in trainer.model.named_parameters()},
                             "logits": trainer.model(TOKENS.to(device)).logits.cpu()})
            assert queue.get()


def test_a_push_from_another_process_makes_the_rollout_equal_to_the_trainer():
    context = multiprocessing.get_context("spawn")
    cpu_ranks(_pushes_across_processes, 2, context.SimpleQueue(), context.SimpleQueue())


@pytest.mark.gpu
def test_a_push_by_cuda_ipc_from_another_process_makes_the_rollout_equal_to_the_trainer():
    context = multiprocessing.get_context("spawn")
    spawn_ranks(_pushes_across_processes, 2, context.SimpleQueue(), context.SimpleQueue(), "cuda")


def test_the_weight_sync_bench_runs_tiny_on_the_cpu(tmp_path):
    """`bench_e2e_throughput.py --weight-sync --tiny`: the floor, the push and its copy alone, the
    receiver a rollout worker in a spawned process (about 15 s on 2 cores: the process's imports)."""
    import sys

    sys.path.insert(0, "benchmarks")
    from bench_e2e_throughput import PUSH, PUSH_COPY, SYNC_FLOOR, main

    rows = main(["--weight-sync", "--tiny", "--results", str(tmp_path / "rows.jsonl")])
    assert [row["provider"] for row in rows] == [SYNC_FLOOR, PUSH, PUSH_COPY]
    assert len({row["shape"]["bytes"] for row in rows}) == 1 and rows[0]["shape"]["bytes"] > 0
    assert all(row["gb_per_s"] > 0 and row["share_of_floor"] > 0 for row in rows)
    assert 0 < rows[1]["locked_ms"] <= rows[1]["ms"] and rows[1]["lock_wait_ms"] >= 0
