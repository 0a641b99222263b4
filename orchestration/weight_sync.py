"""Trainer → rollout weight updates: the student's parameters streamed in size-bounded buckets.

A bucket is one flat ``uint8`` buffer holding several tensors of any dtypes back to back, each
at an offset aligned to `ALIGNMENT` bytes (so that a byte slice can be viewed as the tensor's
dtype). Its metadata is (names, dtypes, shapes); the offsets follow from the dtypes and shapes
alone (`bucket_layout`), so the sender and the receiver agree on them without sending them.
`plan_buckets` fills buckets greedily in the parameters' own order up to ``bucket_bytes``; a
tensor larger than that travels alone. Every tensor is in exactly one bucket.

Three ways a bucket travels, one receiver (`WeightReceiver`) for all:

- ``distributed``: `WeightSender.send` broadcasts every bucket from rank 0 of a *weight group*
  that joins trainer rank 0 and every rollout worker (gloo on CPU, NCCL on GPUs); each receiver
  takes each bucket with `WeightReceiver.receive_broadcast(names, dtypes, shapes, version)`.
- ``cuda_ipc``: a rollout worker on the trainer's GPU. `WeightSender.share` packs one bucket on
  the GPU and returns a CUDA IPC handle of it (torch's multiprocessing reduction); the receiver
  maps that memory and copies out of it (`receive_buffer`): one device-to-device copy into its
  parameters, no host round trip. The sender keeps the buffer until `release_shared`.
  `WeightSender.share_tensors` skips the packing: one CUDA IPC handle per parameter, of the
  parameter's own storage, so the receiver's copies are the update's only device traffic; while
  those storages stay put, later updates send a `MappedTensors` marker instead of the handles
  and the metadata.
- a plain tensor (the Ray object store, or tests in one process): `receive_buffer` with the
  packed buffer itself.

And one way without a receiver's call: ``push``. The receiver shares its flat parameter buffer
once (`WeightReceiver.share_buffer`, `shared_weights`: CUDA IPC on its GPU, shared memory on
its node); the trainer maps it once (`WeightPusher`) and each update is the trainer's own lock,
copy and published version.

The weight group is a *stateless* process group: a ``TCPStore`` hosted by the sender, a
``PrefixStore`` named after the group, and a ``ProcessGroupGloo`` / ``ProcessGroupNCCL``
constructed directly on it, its collectives called on that object. Nothing is registered in
``torch.distributed``'s global state, so the trainer may already belong to its own default group
(the students' data-parallel group) and the rollout workers need none. ``dist.new_group`` would
instead need every process of one default world (trainers, teachers and rollouts) to create the
group together and to agree on every later group creation; slime's copy of
``_new_process_group_helper`` registers a second "main" group through a private helper whose
signature changes between torch releases. The objects used here are the documented classes that
vLLM's stateless groups use too.

Locking: the receiver owns one lock. A generation holds it for its whole duration
(`WeightReceiver.generation`); `pause` takes it (so it waits for a running generation) and marks
the receiver paused, which keeps new generations waiting; bucket calls are refused unless paused
and take the lock too; `resume` refuses while an update is incomplete (a half-updated model never
generates), then publishes the new ``weight_version`` and wakes the waiting generations;
`WeightReceiver.receive_whole` does all three for a one-payload update in one call, holding the
lock throughout. The sender has its own lock so that two updates from one trainer never interleave.
Once the buffer is shared, the receiver's lock also takes the cross-process `WeightLock` (a
generation for its whole run, a pause until its resume), which a push holds while it writes,
and ``weight_version`` is the word in that lock's file.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from .flat_parameters import flat_offsets, flat_region, flatten_parameters
from .shared_weights import SharedWeights, WeightLock, file_backed_buffer, map_shared, share_flat_buffer

ALIGNMENT = 64  # bytes: every tensor of a bucket starts at a multiple of this
DEFAULT_BUCKET_BYTES = 512 * 2**20

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]


# ---- buckets: pure functions ----------------------------------------------------------------

def as_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    """A ``torch.dtype`` from itself or its name (``"bfloat16"``, ``"torch.bfloat16"``)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        candidate = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise ValueError(f"dtype: expected a torch.dtype or its name, got {value!r}")


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return _numel(shape) * dtype.itemsize


def bucket_layout(dtypes: Sequence[Union[str, torch.dtype]], shapes: Sequence[Sequence[int]]
                  ) -> tuple[tuple[int, ...], int]:
    """(byte offset of each tensor, total bytes) of a bucket holding tensors of these dtypes and
    shapes in this order: each offset is the end of the previous tensor rounded up to
    `ALIGNMENT`; the total is the end of the last tensor."""
    if len(dtypes) != len(shapes):
        raise ValueError(f"dtypes, shapes: expected equal lengths, got {len(dtypes)} and {len(shapes)}")
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes):
        start = _aligned(end)
        offsets.append(start)
        end = start + _nbytes(as_dtype(dtype), shape)
    return tuple(offsets), end


@dataclass(frozen=True)
class Bucket:
    """Metadata of one bucket: the tensors' names, dtypes (as sent) and shapes, in buffer order."""
    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        return bucket_layout(self.dtypes, self.shapes)[0]

    @property
    def nbytes(self) -> int:
        return bucket_layout(self.dtypes, self.shapes)[1]


def plan_buckets(specs: Iterable[tuple[str, Union[str, torch.dtype], Sequence[int]]], bucket_bytes: int
                 ) -> list[Bucket]:
    """``(name, dtype, shape)`` of every tensor, in order → buckets of at most ``bucket_bytes``
    (`bucket_layout` bytes, alignment included), filled greedily in that order; a tensor larger
    than ``bucket_bytes`` gets a bucket of its own. Raises on a repeated name."""
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: expected an int >= 1, got {bucket_bytes!r}")
    buckets: list[Bucket] = []
    names: list[str] = []
    dtypes: list[torch.dtype] = []
    shapes: list[tuple[int, ...]] = []
    seen: set[str] = set()
    end = 0
    for name, dtype, shape in specs:
        if name in seen:
            raise ValueError(f"specs: the name {name!r} appears twice")
        seen.add(name)
        dtype, shape = as_dtype(dtype), tuple(int(size) for size in shape)
        grown = _aligned(end) + _nbytes(dtype, shape)
        if names and grown > bucket_bytes:
            buckets.append(Bucket(tuple(names), tuple(dtypes), tuple(shapes)))
            names, dtypes, shapes = [], [], []
            grown = _nbytes(dtype, shape)
        names.append(name)
        dtypes.append(dtype)
        shapes.append(shape)
        end = grown
    if names:
        buckets.append(Bucket(tuple(names), tuple(dtypes), tuple(shapes)))
    return buckets


def _bucket_of(names: Sequence[str], dtypes: Sequence, shapes: Sequence[Sequence[int]]) -> Bucket:
    """The `Bucket` of an update's metadata as it arrives (dtypes as names or dtypes)."""
    return Bucket(tuple(names), tuple(as_dtype(d) for d in dtypes), tuple(tuple(int(s) for s in shape)
                                                                         for shape in shapes))


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return buffer[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)


def bucket_views(buffer: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """The tensors of a packed bucket as views of ``buffer`` (``uint8``, ``[bucket.nbytes]``)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != bucket.nbytes:
        raise ValueError(f"buffer: expected a 1-D uint8 tensor of {bucket.nbytes} bytes, got {buffer.dtype} "
                         f"{tuple(buffer.shape)}")
    return [_view(buffer, offset, dtype, shape)
            for offset, dtype, shape in zip(bucket.offsets, bucket.dtypes, bucket.shapes)]


def pack_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor], device: Union[str, torch.device] = "cpu"
                ) -> torch.Tensor:
    """One ``uint8`` buffer ``[bucket.nbytes]`` on ``device`` holding ``tensors`` (in the bucket's
    order, each cast to the bucket's dtype for it). Alignment padding is left uninitialized."""
    if len(tensors) != len(bucket.names):
        raise ValueError(f"tensors: expected {len(bucket.names)} for the bucket, got {len(tensors)}")
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for name, view, tensor in zip(bucket.names, bucket_views(buffer, bucket), tensors):
            if tuple(tensor.shape) != tuple(view.shape):
                raise ValueError(f"tensors: {name!r} has shape {tuple(tensor.shape)}, the bucket expects "
                                 f"{tuple(view.shape)}")
            view.copy_(tensor)
    return buffer


# ---- the weight group ---------------------------------------------------------------------

class WeightGroup:
    """A stateless process group of ``world_size`` ranks (the module docstring says why):
    rank 0 hosts the ``TCPStore`` at ``master_address:master_port`` and is the broadcast source.
    Every rank must construct it at the same time (it is a rendezvous). ``backend``: ``gloo``
    (CPU buffers) or ``nccl`` (buffers on the current CUDA device)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 backend: str = "gloo", timeout: timedelta = timedelta(minutes=30)):
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: expected gloo or nccl, got {backend!r}")
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size: expected an int >= 2 (the sender and at least one receiver), "
                             f"got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
        if not group_name:
            raise ValueError("group_name: expected a non-empty name")
        self.rank, self.world_size, self.group_name, self.backend = rank, world_size, group_name, backend
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                                    wait_for_workers=False)
        prefixed = dist.PrefixStore(group_name, self._store)
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor, wait: bool = True):
        """Broadcast of ``tensor`` from rank 0 into every rank's ``tensor`` (in place); returns the
        work handle when not ``wait``-ing (the tensor must stay alive until its ``wait()``)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        work = self._group.broadcast([tensor], options)
        if wait:
            work.wait()
            return None
        return work

    def destroy(self) -> None:
        self._group.shutdown()
        self._group = self._store = None


# ---- metrics ------------------------------------------------------------------------------

@dataclass(frozen=True)
class UpdateMetrics:
    """One weight update: bytes moved (bucket bytes, alignment included), buckets, seconds."""
    weight_version: int
    bytes: int
    buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return dict(asdict(self), gb_per_s=self.gb_per_s)


# ---- sender -------------------------------------------------------------------------------

class WeightSender:
    """Trainer rank 0's side. ``source``: a module (its ``named_parameters()``) or a callable
    returning ``(name, tensor)`` pairs (full tensors: gather sharded ones inside it), the same
    names, shapes and order on every call; a module's Parameter objects are taken once, at
    construction (their data, moved or not, at each update). ``dtype``: floating tensors are
    sent in it (e.g. ``torch.bfloat16`` for a bf16 rollout of an fp32-master trainer); None
    sends each tensor's own dtype. The bucket plan (`buckets`) is fixed at construction."""

    def __init__(self, source: Union[torch.nn.Module, NamedTensors], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: Optional[torch.dtype] = None):
        # a module's Parameter objects, once: their data is read at each update, their names cannot change
        self._parameters: Optional[list[torch.Tensor]] = None
        if isinstance(source, torch.nn.Module):
            named = list(source.named_parameters())
            self._named_tensors: NamedTensors = lambda: named
            self._parameters = [parameter for _, parameter in named]
        else:
            self._named_tensors = source
        self._dtype = dtype
        self.buckets = plan_buckets(((name, self._sent_dtype(tensor), tensor.shape)
                                     for name, tensor in self._named_tensors()), bucket_bytes)
        self.weight_version = 0
        self.last_update: Optional[UpdateMetrics] = None
        self._lock = threading.Lock()
        self._group: Optional[WeightGroup] = None
        self._shared: list[torch.Tensor] = []
        self._sharing: Optional[tuple[int, int, float]] = None  # (weight_version, next bucket, start)
        self._shared_bytes = 0  # bytes of the update `share_tensors` handed out
        # what `share_tensors` last sent handles of: ((pointer, dtype, shape) each, its weight_version, bytes)
        self._handed: Optional[tuple[tuple, int, int]] = None

    def _sent_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return self._dtype if self._dtype is not None and tensor.is_floating_point() else tensor.dtype

    def _current(self) -> dict[str, torch.Tensor]:
        """The source's tensors now, by name; raises if they are not the planned ones."""
        current = {name: tensor.detach() for name, tensor in self._named_tensors()}
        planned = [name for bucket in self.buckets for name in bucket.names]
        if list(current) != planned:
            raise RuntimeError(f"source: its names changed since the bucket plan ({len(current)} tensors now, "
                               f"{len(planned)} planned)")
        return current

    def _bucket(self, index: int, current: Optional[dict] = None) -> tuple[Bucket, list[torch.Tensor]]:
        if not isinstance(index, int) or not 0 <= index < len(self.buckets):
            raise ValueError(f"index: expected a bucket index in [0, {len(self.buckets)}), got {index!r}")
        current = self._current() if current is None else current
        bucket = self.buckets[index]
        return bucket, [current[name] for name in bucket.names]

    def pack(self, index: int, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """Bucket ``index`` packed on ``device`` (`pack_bucket`): the payload of
        `WeightReceiver.receive_buffer` when it travels as a tensor (Ray's object store)."""
        bucket, tensors = self._bucket(index)
        return pack_bucket(bucket, tensors, device)

    def _next_version(self, weight_version: int) -> None:
        if not isinstance(weight_version, int) or weight_version <= self.weight_version:
            raise ValueError(f"weight_version: expected an int > {self.weight_version} (the last one sent), "
                             f"got {weight_version!r}")

    def init_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                   backend: str = "gloo", timeout: timedelta = timedelta(minutes=30)) -> None:
        """Joins the weight group as rank 0 (host of its store); the receivers join at the same time."""
        if self._group is not None:
            raise RuntimeError(f"init_group: already in the weight group {self._group.group_name!r}")
        self._group = WeightGroup(master_address, master_port, 0, world_size, group_name, backend, timeout)

    def destroy_group(self) -> None:
        if self._group is None:
            raise RuntimeError("destroy_group: not in a weight group")
        self._group.destroy()
        self._group = None

    def send(self, weight_version: int) -> UpdateMetrics:
        """Broadcasts every bucket, in plan order, over the weight group; each receiver must call
        `WeightReceiver.receive_broadcast` once per bucket in the same order (concurrently: the
        broadcasts block until every rank is in). Two buckets are in flight at a time (one packs
        while the previous one travels)."""
        if self._group is None:
            raise RuntimeError("send: call init_group first")
        with self._lock:
            self._next_version(weight_version)
            start = time.perf_counter()
            total, pending, current = 0, None, self._current()
            for index in range(len(self.buckets)):
                bucket, tensors = self._bucket(index, current)
                buffer = pack_bucket(bucket, tensors, self._group.device)
                work = self._group.broadcast(buffer, wait=False)
                if pending is not None:
                    pending[0].wait()
                pending = (work, buffer)
                total += buffer.numel()
            if pending is not None:
                pending[0].wait()
            if self._group.device.type == "cuda":
                torch.cuda.synchronize(self._group.device)
            return self._finish(weight_version, total, time.perf_counter() - start)

    def _finish(self, weight_version: int, total: int, seconds: float) -> UpdateMetrics:
        self.weight_version = weight_version
        self.last_update = UpdateMetrics(weight_version, total, len(self.buckets), seconds)
        return self.last_update

    def share(self, index: int, weight_version: int) -> tuple:
        """Bucket ``index`` (0, 1, ... in order within an update) packed on the tensors' CUDA device,
        as the arguments of `WeightReceiver.receive_buffer`: ``(names, dtypes, shapes, (rebuild,
        args), weight_version)`` with a CUDA IPC handle of the buffer. The buffer stays alive until
        `release_shared`, to be called once the receivers of the bucket have returned (they copy
        out of it before returning)."""
        from torch.multiprocessing.reductions import reduce_tensor

        with self._lock:
            self._next_version(weight_version)
            expected = 0 if self._sharing is None else self._sharing[1]
            if index != expected:
                raise ValueError(f"index: expected bucket {expected} of the update, got {index!r}")
            if index == 0:
                self._sharing = (weight_version, 0, time.perf_counter())
            elif weight_version != self._sharing[0]:
                raise ValueError(f"weight_version: the update in progress is {self._sharing[0]}, got {weight_version}")
            bucket, tensors = self._bucket(index)
            if not tensors[0].is_cuda:
                raise RuntimeError(f"share: CUDA IPC needs CUDA tensors, the source's are on {tensors[0].device}")
            buffer = pack_bucket(bucket, tensors, tensors[0].device)
            torch.cuda.current_stream(buffer.device).synchronize()  # another process reads it next
            self._shared.append(buffer)
            self._sharing = (weight_version, index + 1, self._sharing[2])
            return bucket.names, bucket.dtypes, bucket.shapes, reduce_tensor(buffer), weight_version

    def share_tensors(self, weight_version: int) -> tuple:
        """The whole update as CUDA IPC handles of the source's tensors themselves (no packing): the
        arguments of `WeightReceiver.receive_buffer` with a list payload, one ``(rebuild, args)`` per
        tensor in plan order. A receiver on the same GPU copies straight out of the trainer's
        parameters, one device-to-device copy per tensor. Tensors that need a cast (``dtype``) are
        cast into copies kept until `release_shared`, which ends the update and returns its metrics
        once the receivers have returned. The trainer must not step while they copy. When the
        tensors are the storages (pointer, dtype, shape) whose handles an earlier update sent, the
        arguments are ``(None, None, None, MappedTensors(count, handed_at), weight_version)``:
        every receiver keeps those tensors mapped, checked against their names, dtypes and shapes
        when they were mapped."""
        from torch.multiprocessing.reductions import reduce_tensor

        with self._lock:
            self._next_version(weight_version)
            if self._sharing is not None:
                raise RuntimeError(f"share_tensors: the update to {self._sharing[0]} is still in progress")
            start = time.perf_counter()
            if self._parameters is not None and self._handed is not None:
                # a module's names cannot change: its storages alone say whether the handed handles still hold
                storages = tuple((tensor.data_ptr(), tensor.dtype, tensor.shape) for tensor in self._parameters)
                if storages == self._handed[0]:
                    return self._share_mapped(weight_version, start, self._parameters[0].device)
            current = self._current()
            names = [name for bucket in self.buckets for name in bucket.names]
            tensors = [current[name] for name in names]
            if not all(tensor.is_cuda for tensor in tensors):
                raise RuntimeError("share_tensors: CUDA IPC needs CUDA tensors; the source has tensors on "
                                   f"{sorted({str(tensor.device) for tensor in tensors})}")
            sent = [tensor if tensor.dtype == self._sent_dtype(tensor) else tensor.to(self._sent_dtype(tensor))
                    for tensor in tensors]
            self._shared.extend(fresh for fresh, tensor in zip(sent, tensors) if fresh is not tensor)
            torch.cuda.current_stream(sent[0].device).synchronize()  # another process reads them next
            # the parameters' storages do not move between updates: their handles go once, then a marker
            storages = tuple((tensor.data_ptr(), tensor.dtype, tensor.shape) for tensor in sent)
            uncast = all(fresh is tensor for fresh, tensor in zip(sent, tensors))
            if uncast and self._handed is not None and storages == self._handed[0]:
                return self._share_mapped(weight_version, start, None)
            self._sharing = (weight_version, len(self.buckets), start)
            self._shared_bytes = sum(tensor.numel() * tensor.element_size() for tensor in sent)
            self._handed = (storages, weight_version, self._shared_bytes) if uncast else None
            return (tuple(names), tuple(tensor.dtype for tensor in sent), tuple(tuple(tensor.shape) for tensor in sent),
                    [reduce_tensor(tensor) for tensor in sent], weight_version)

    def _share_mapped(self, weight_version: int, start: float, device: Optional[torch.device]) -> tuple:
        """`share_tensors`'s arguments when the receivers hold the handed tensors mapped already;
        waits for ``device``'s current stream first unless None (already waited for)."""
        if device is not None:
            torch.cuda.current_stream(device).synchronize()  # another process reads the tensors next
        storages, handed_at, nbytes = self._handed
        self._sharing, self._shared_bytes = (weight_version, len(self.buckets), start), nbytes
        return None, None, None, MappedTensors(len(storages), handed_at), weight_version

    def release_shared(self) -> Optional[UpdateMetrics]:
        """Frees the buffers handed out by `share` (their receivers have returned). After the last
        bucket of an update, ends it and returns its metrics (seconds from the first `share`)."""
        with self._lock:
            self._shared.clear()
            if self._sharing is None or self._sharing[1] < len(self.buckets):
                return None
            weight_version, _, start = self._sharing
            self._sharing = None
            total = self._shared_bytes or sum(bucket.nbytes for bucket in self.buckets)
            self._shared_bytes = 0
            return self._finish(weight_version, total, time.perf_counter() - start)


# ---- pusher: the trainer writes into a rollout worker's shared buffer ------------------------

class WeightPusher:
    """Trainer rank 0's side of a rollout worker's shared buffer (`WeightReceiver.share_buffer`):
    maps it once, then each `push` is the trainer's own work, no message to the worker: take the
    worker's lock (waits for a running generation; new ones wait), copy the source into the
    buffer, wait for the copy, publish ``weight_version``, let go of the lock.

    ``source``: a module (its ``named_parameters()``) or a callable returning ``(name, tensor)``
    pairs (full tensors, e.g. FSDP2's gathered ones), the worker's names and shapes in its order
    (dtypes may differ: the copy casts). A module whose parameters are one flat buffer
    (`flat_parameters`) is pushed with one copy of that buffer; otherwise one copy a tensor into
    its view of the shared buffer. Raises on a layout mismatch, naming the first one."""

    def __init__(self, source: Union[torch.nn.Module, NamedTensors], shared: SharedWeights):
        self._parameters: Optional[list[torch.Tensor]] = None
        if isinstance(source, torch.nn.Module):
            named = [(name, parameter) for name, parameter in source.named_parameters()]
            self._named_tensors: NamedTensors = lambda: named
            self._parameters = [parameter for _, parameter in named]
        else:
            self._named_tensors = source
        check_layout([(name, tuple(tensor.shape)) for name, tensor in self._named_tensors()], shared)
        self.shared = shared
        self._target = map_shared(shared)
        offsets, total = flat_offsets([_numel(shape) for shape in shared.shapes])
        if total != self._target.numel():
            raise ValueError(f"shared: the buffer holds {self._target.numel()} elements, its layout {total}")
        self._views = [self._target[offset:offset + _numel(shape)].view(shape)
                       for offset, shape in zip(offsets, shared.shapes)]
        # a flat source: pushed as one copy; every push checks that no parameter has moved since
        self._flat = None if self._parameters is None else flat_region([p.detach() for p in self._parameters])
        if self._flat is not None and self._flat.numel() != total:
            self._flat = None
        self._flat_at = None if self._flat is None else self._pointers()
        self._lock = WeightLock(shared.lock_path)
        self.bytes = sum(view.numel() * view.element_size() for view in self._views)
        self.last_update: Optional[UpdateMetrics] = None

    @property
    def buffer(self) -> torch.Tensor:
        """The worker's flat buffer, mapped in this process."""
        return self._target

    def _pointers(self) -> tuple[int, ...]:
        """Each parameter's address relative to the flat buffer's (a storage moved as a whole, e.g.
        into shared memory, keeps them; a parameter rebound elsewhere does not)."""
        base = self._flat.data_ptr()
        return tuple(parameter.data_ptr() - base for parameter in self._parameters)

    def push(self, weight_version: int) -> tuple[UpdateMetrics, float]:
        """The update to ``weight_version`` (above); its metrics (bytes written, 1 bucket, the
        seconds from holding the lock to the published version) and the seconds waited for the
        lock. Raises unless ``weight_version`` is above the worker's."""
        with self._lock.held() as waited:
            published = self._lock.version()
            if not isinstance(weight_version, int) or isinstance(weight_version, bool) or weight_version <= published:
                raise ValueError(f"weight_version: expected an int > {published} (the rollout worker's), "
                                 f"got {weight_version!r}")
            start = time.perf_counter()
            with torch.no_grad():
                if self._flat is not None:
                    if self._pointers() != self._flat_at:
                        raise RuntimeError("source: a parameter no longer lies where it did in the flat buffer "
                                           "mapped (rebound since); map the rollout worker's buffer again")
                    self._target.copy_(self._flat)
                else:
                    sources = [tensor.detach() for _, tensor in self._named_tensors()]
                    if len(sources) != len(self._views):
                        raise RuntimeError(f"source: {len(sources)} tensors now, {len(self._views)} mapped")
                    if all(s.dtype == v.dtype and s.device == v.device for s, v in zip(sources, self._views)):
                        torch._foreach_copy_(self._views, sources)
                    else:
                        for view, tensor in zip(self._views, sources):
                            view.copy_(tensor)
            if self._target.is_cuda:
                torch.cuda.current_stream(self._target.device).synchronize()
            self._lock.publish(weight_version)
            seconds = time.perf_counter() - start
        self.last_update = UpdateMetrics(weight_version, self.bytes, 1, seconds)
        return self.last_update, waited

    def close(self) -> None:
        self._lock.close()
        self._views, self._target, self._flat = [], None, None


def check_layout(named_shapes: Sequence[tuple[str, tuple[int, ...]]], shared: SharedWeights) -> None:
    """Raises ValueError naming the first tensor whose name or shape differs from ``shared``'s."""
    for index, ((name, shape), theirs, their_shape) in enumerate(zip(named_shapes, shared.names, shared.shapes)):
        if name != theirs:
            raise ValueError(f"shared: tensor {index} is {name!r} here, {theirs!r} in the rollout worker")
        if tuple(shape) != tuple(their_shape):
            raise ValueError(f"shared: {name!r} is {tuple(shape)} here, {tuple(their_shape)} in the rollout worker")
    if len(named_shapes) != len(shared.names):
        raise ValueError(f"shared: {len(named_shapes)} tensors here, {len(shared.names)} in the rollout worker")


# ---- receiver -----------------------------------------------------------------------------

@dataclass(frozen=True)
class MappedTensors:
    """A `WeightReceiver.receive_buffer` payload: the ``count`` tensors of the receiver's last list
    payload again, that of the update to ``handed_at`` (the sender's parameters did not move, so
    their handles are not sent twice)."""
    count: int
    handed_at: int


@dataclass
class _PendingUpdate:
    weight_version: int
    received: set
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0


class WeightReceiver:
    """A rollout worker's side: writes received buckets into ``model``'s parameters in place
    (``param.data.copy_``, casting from the sent dtype) and guards generation (module docstring).
    One update = the buckets of one ``weight_version`` between `pause` and `resume`; it must
    cover every parameter exactly once."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._parameters = dict(model.named_parameters())
        self._flat = flat_region(list(self._parameters.values()))  # set when the model is flattened
        self._mapped_flat: Optional[torch.Tensor] = None  # the region of ``_mapped``, if one
        self._mapped_bytes = 0  # the bytes of ``_mapped``'s tensors (padding between them not counted)
        self._flat_bucket: Optional[Bucket] = None  # the last whole flat update, its checks passed
        self._mapped_bucket: Optional[Bucket] = None  # the layout of ``_mapped``, its checks passed
        self._mapped_at = 0  # the weight_version of the update whose list payload ``_mapped`` is
        self._condition = threading.Condition(threading.Lock())
        self._paused = False
        self._pending: Optional[_PendingUpdate] = None
        self._group: Optional[WeightGroup] = None
        self._mapped: list[torch.Tensor] = []  # the last list payload's tensors (receive_buffer)
        self._weight_version = 0
        self._lock: Optional[WeightLock] = None  # the cross-process lock, once the buffer is shared
        self._shared: Optional[SharedWeights] = None
        self._buffer_file: Optional[int] = None  # the descriptor keeping a CPU shared buffer's file
        self.last_update: Optional[UpdateMetrics] = None

    @property
    def weight_version(self) -> int:
        """The weights' version: once the buffer is shared, the one last published in the lock file
        (by a `WeightPusher` or by this receiver's own updates)."""
        return self._weight_version if self._lock is None else self._lock.version()

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self._weight_version = value
        if self._lock is not None:
            self._lock.publish(value)

    # -- generation side --
    @contextmanager
    def generation(self) -> Iterator[int]:
        """Holds the lock for a generation: waits while paused, and once the buffer is shared for
        a running push; yields the weight_version (read under the lock). A shared CUDA buffer:
        the device's current stream is waited for before the lock is let go."""
        with self._condition:
            while self._paused:
                self._condition.wait()
            if self._lock is None:
                yield self._weight_version
                return
            self._lock.acquire()
            try:
                yield self._lock.version()
            finally:
                if self._flat.is_cuda:  # a push may write the weights once the lock is let go
                    torch.cuda.current_stream(self._flat.device).synchronize()
                self._lock.release()

    @property
    def paused(self) -> bool:
        return self._paused

    def _set_paused(self, paused: bool) -> None:
        """Paused: also holds the cross-process lock (once shared), so a push waits for the update."""
        if self._lock is not None and paused != self._paused:
            self._lock.acquire() if paused else self._lock.release()
        self._paused = paused
        if not paused:
            self._condition.notify_all()

    def pause(self) -> None:
        """Blocks new generations (and pushes); returns once the running generation (if any), or
        push, has finished."""
        with self._condition:
            self._set_paused(True)

    def share_buffer(self) -> SharedWeights:
        """The flat parameter buffer and the lock, shared once (`shared_weights`): a
        `WeightPusher` in another process (or this one) maps them and updates the weights by
        itself. A CPU model's buffer moves into shared memory first. Later calls return the same.
        Raises unless the model is flattened (`flat_parameters`), or while paused."""
        with self._condition:
            if self._shared is not None:
                return self._shared
            if self._flat is None:
                raise RuntimeError("share_buffer: the model's parameters are not one flat buffer (flat_parameters: "
                                   "one dtype and device)")
            if self._paused:
                raise RuntimeError("share_buffer: the worker is paused; continue_generation first")
            path = None
            if not self._flat.is_cuda:
                buffer, self._buffer_file, path = file_backed_buffer(self._flat.numel(), self._flat.dtype)
                flatten_parameters(self._model, into=buffer)
                self._flat = buffer
            lock = WeightLock()
            lock.publish(self._weight_version)
            self._shared = share_flat_buffer(self._flat, list(self._parameters.items()), lock.path, path)
            self._lock = lock
            return self._shared

    def resume(self) -> Optional[UpdateMetrics]:
        """Ends the pause. An update received during it becomes the model's ``weight_version``
        (its metrics are returned); raises, staying paused, if that update missed parameters."""
        with self._condition:
            return self._resume_locked()

    def _resume_locked(self) -> Optional[UpdateMetrics]:
        pending, metrics = self._pending, None
        if pending is not None:
            # ``received`` holds parameter names only (`_receive_locked` checks each), so a count tells
            missing = [] if len(pending.received) == len(self._parameters) else \
                [name for name in self._parameters if name not in pending.received]
            if missing:
                raise RuntimeError(f"resume: the update to weight_version {pending.weight_version} is incomplete: "
                                   f"{len(missing)} parameters not received (first: {missing[:3]}); the worker "
                                   "stays paused")
            metrics = UpdateMetrics(pending.weight_version, pending.bytes, pending.buckets, pending.seconds)
            self.weight_version, self.last_update, self._pending = pending.weight_version, metrics, None
        self._set_paused(False)
        return metrics

    # -- update side --
    def join_group(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                   backend: str = "gloo", timeout: timedelta = timedelta(minutes=30)) -> None:
        if self._group is not None:
            raise RuntimeError(f"join_group: already in the weight group {self._group.group_name!r}")
        if rank == 0:
            raise ValueError("rank: 0 is the sender's; a receiver's rank is 1 or more")
        self._group = WeightGroup(master_address, master_port, rank, world_size, group_name, backend, timeout)

    def leave_group(self, group_name: str) -> None:
        self._check_group(group_name)
        self._group.destroy()
        self._group = None

    def _check_group(self, group_name: str) -> None:
        if self._group is None or self._group.group_name != group_name:
            joined = None if self._group is None else self._group.group_name
            raise RuntimeError(f"group_name: {group_name!r} is not this worker's weight group (joined: {joined!r})")

    def receive_broadcast(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence[Sequence[int]],
                          group_name: str, weight_version: int) -> dict:
        """The next bucket of `WeightSender.send` (same order) into the parameters."""
        self._check_group(group_name)

        def fetch(bucket: Bucket) -> torch.Tensor:
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self._group.device)
            self._group.broadcast(buffer)
            return buffer

        bucket = _bucket_of(names, dtypes, shapes)
        with self._condition:
            return self._receive_locked(bucket, weight_version, fetch)

    def receive_buffer(self, names: Optional[Sequence[str]], dtypes: Optional[Sequence],
                       shapes: Optional[Sequence[Sequence[int]]], payload: Any, weight_version: int) -> dict:
        """A bucket packed by `pack_bucket` into the parameters. ``payload``: that ``uint8`` buffer,
        ``(rebuild, args)`` of a CUDA IPC handle of it (`WeightSender.share`), or a list of such
        handles, one per tensor of ``names`` (`WeightSender.share_tensors`), or `MappedTensors`
        (the tensors of the last list payload again; ``names``, ``dtypes``, ``shapes`` may then be
        None: the layout checked when they were mapped); copied out of before this returns. The
        tensors of a list payload stay mapped until the next list payload."""
        with self._condition:
            return self._receive_buffer_locked(names, dtypes, shapes, payload, weight_version)

    def receive_whole(self, names: Optional[Sequence[str]], dtypes: Optional[Sequence],
                      shapes: Optional[Sequence[Sequence[int]]], payload: Any, weight_version: int
                      ) -> UpdateMetrics:
        """`pause`, `receive_buffer` of a payload holding the whole update, and `resume`, in one
        call under the lock: waits for a running generation, and the next one runs on the new
        weights of ``weight_version``; returns the update's metrics. Refused while paused (a
        caller that paused continues itself). A payload its checks refuse (ValueError, raised
        before any write) leaves the worker as it was; any other failure, or a payload that
        misses parameters, leaves it paused (a half-updated model never generates)."""
        with self._condition:
            if self._paused:
                raise RuntimeError("receive_whole: the worker is paused (pause_generation was called): update with "
                                   "the bucket calls, then continue_generation")
            self._set_paused(True)
            try:
                self._receive_buffer_locked(names, dtypes, shapes, payload, weight_version)
            except ValueError:  # the checks' refusals, all before the first write
                if self._pending is not None and not self._pending.received:
                    self._pending = None
                if self._pending is None:
                    self._set_paused(False)
                raise
            return self._resume_locked()

    def _receive_buffer_locked(self, names, dtypes, shapes, payload: Any, weight_version: int) -> dict:
        mapped_again = isinstance(payload, MappedTensors)
        if mapped_again:
            if len(self._mapped) != payload.count or payload.handed_at != self._mapped_at:
                raise ValueError(f"payload: {payload} needs the {payload.count} tensors of the list payload of "
                                 f"weight_version {payload.handed_at} mapped here; this worker holds "
                                 f"{len(self._mapped)} of weight_version {self._mapped_at}")
        if mapped_again and names is None and dtypes is None and shapes is None:
            if self._mapped_bucket is None:
                raise ValueError("names: None needs the layout of the mapped tensors checked by an earlier update")
            bucket = self._mapped_bucket
        elif names is None or dtypes is None or shapes is None:
            raise ValueError("names, dtypes, shapes: None only with a MappedTensors payload (all three)")
        else:
            bucket = _bucket_of(names, dtypes, shapes)

        def fetch(bucket: Bucket):
            if isinstance(payload, torch.Tensor):
                return payload
            if mapped_again:
                if len(self._mapped) != len(bucket.names):
                    raise ValueError(f"payload: {payload} holds {payload.count} tensors, the update names "
                                     f"{len(bucket.names)}")
                return self._mapped
            if isinstance(payload, list):
                if len(payload) != len(bucket.names):
                    raise ValueError(f"payload: expected {len(bucket.names)} tensor handles, got {len(payload)}")
                return [rebuild(*arguments) for rebuild, arguments in payload]
            rebuild, arguments = payload
            return rebuild(*arguments)

        def adopt(tensors: list) -> None:
            """A list payload whose checks passed: its tensors are the mapped ones from now on."""
            self._mapped = tensors
            self._mapped_flat = flat_region(tensors)
            self._mapped_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            self._flat_bucket = self._mapped_bucket = None  # new tensors: their layout recorded below
            self._mapped_at = weight_version

        return self._receive_locked(bucket, weight_version, fetch, mapped_again,
                                    adopt if isinstance(payload, list) else None)

    def _receive_locked(self, bucket: Bucket, weight_version: int, fetch: Callable[[Bucket], Any],
                        mapped_again: bool = False, adopt: Optional[Callable[[list], None]] = None) -> dict:
        if not self._paused:
            raise RuntimeError("update: call pause_generation before updating weights (a generation could "
                               "otherwise see a half-updated model)")
        pending = self._start(weight_version)
        if mapped_again and not pending.received and bucket == self._flat_bucket:
            # the tensors mapped and checked at the last list payload, the whole model, flat
            start = time.perf_counter()
            fetch(bucket)
            return self._copy_flat(pending, bucket, start)
        for name, shape in zip(bucket.names, bucket.shapes):
            parameter = self._parameters.get(name)
            if parameter is None:
                raise ValueError(f"names: {name!r} is not a parameter of this model")
            if tuple(parameter.shape) != shape:
                raise ValueError(f"shapes: {name!r} is {shape} in the update, {tuple(parameter.shape)} here")
            if name in pending.received:
                raise ValueError(f"names: {name!r} came twice in the update to weight_version {weight_version}")
        start = time.perf_counter()
        fetched = fetch(bucket)
        views = fetched if isinstance(fetched, list) else bucket_views(fetched, bucket)
        with torch.no_grad():
            for name, view, dtype, shape in zip(bucket.names, views, bucket.dtypes, bucket.shapes):
                if view.dtype != dtype or tuple(view.shape) != shape:
                    raise ValueError(f"payload: {name!r} is {view.dtype} {tuple(view.shape)}, the update says "
                                     f"{dtype} {shape}")
            if adopt is not None:
                adopt(fetched)  # only now: a refused payload leaves the earlier mapping in place
            if fetched is self._mapped:
                self._mapped_bucket = bucket  # a MappedTensors payload may then come without the metadata
            if self._whole_flat_update(bucket, fetched):
                self._flat_bucket = bucket  # its next updates skip the checks above (the same mapping)
                return self._copy_flat(pending, bucket, start)
            targets = [self._parameters[name].data for name in bucket.names]
            if all(target.dtype == view.dtype for target, view in zip(targets, views)):
                torch._foreach_copy_(targets, list(views))  # one multi-tensor launch, not one per tensor
            else:
                for target, view in zip(targets, views):
                    target.copy_(view)
        moved = fetched.numel() if isinstance(fetched, torch.Tensor) else sum(v.numel() * v.element_size()
                                                                               for v in views)
        return self._received(pending, bucket, views[0] if views else None, moved, start)

    def _copy_flat(self, pending: _PendingUpdate, bucket: Bucket, start: float) -> dict:
        """The whole update as one copy (cast included) of the mapped flat region into this
        model's flat buffer; ``pending`` then holds every parameter."""
        with torch.no_grad():
            self._flat.copy_(self._mapped_flat)
        return self._received(pending, bucket, self._mapped_flat, self._mapped_bytes, start)

    @staticmethod
    def _received(pending: _PendingUpdate, bucket: Bucket, source: Optional[torch.Tensor], moved: int,
                  start: float) -> dict:
        """Ends a bucket copied out of ``source``: waits for the copy on CUDA (the sender may free
        or reuse the memory once this returns) and adds the bucket to ``pending``."""
        if source is not None and source.is_cuda:
            torch.cuda.current_stream(source.device).synchronize()
        seconds = time.perf_counter() - start
        pending.received.update(bucket.names)
        pending.bytes += moved
        pending.buckets += 1
        pending.seconds += seconds
        return dict(bytes=moved, seconds=seconds, weight_version=pending.weight_version)

    def _whole_flat_update(self, bucket: Bucket, fetched) -> bool:
        """Whether ``fetched`` is the mapped list payload of every parameter, in this model's order,
        laid out as `flat_parameters` lays out this model (so one copy updates all of them)."""
        return (self._flat is not None and fetched is self._mapped and self._mapped_flat is not None
                and self._mapped_flat.numel() == self._flat.numel() and bucket.names == tuple(self._parameters))

    def _start(self, weight_version: int) -> _PendingUpdate:
        if self._pending is None:
            if not isinstance(weight_version, int) or weight_version <= self.weight_version:
                raise ValueError(f"weight_version: expected an int > {self.weight_version} (this worker's), "
                                 f"got {weight_version!r}")
            self._pending = _PendingUpdate(weight_version, set())
        elif self._pending.weight_version != weight_version:
            raise RuntimeError(f"weight_version: a bucket of {weight_version} arrived while the update to "
                               f"{self._pending.weight_version} is incomplete (two updates may not interleave)")
        return self._pending
