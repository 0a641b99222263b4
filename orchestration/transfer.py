"""How a teacher's packed top-k (`kd_kernels.TopK.pack`, bf16 log-probs and int32 ids, one
buffer per micro-batch) reaches the student that trains on it: one class per mode, chosen
by name from `TRANSFERS`. Each worker holds one instance; the teacher calls `send` (and
`release` when the driver says a step is done), the student `receive`; both call `setup`
with their peers before any scoring. The message that travels through Ray is what `send`
returns: the bytes themselves (object store), a small handle (CUDA IPC, NCCL) or a key of
this process's table (in process: teacher and student in one fused worker).
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any

import numpy as np
import torch

import kd_kernels as kd


class Transfer:
    """One way top-k travels. ``setup(peers, device, sending)``: before any scoring, with the
    process-group ranks of the other side; ``send(topk, step, student_rank)`` → message;
    ``receive(message, device)`` → `TopK`; ``release(step)``: the students are done with the
    buffers of ``step`` and earlier."""

    name = ""

    def setup(self, peers: list[int], device: torch.device, sending: bool) -> None:
        """Nothing to connect by default."""

    def send(self, topk: kd.TopK, step: int, student_rank: int) -> Any:
        raise NotImplementedError

    def receive(self, message: Any, device: torch.device) -> kd.TopK:
        raise NotImplementedError

    def release(self, step: int) -> None:
        """Nothing kept alive by default."""


class ObjectStore(Transfer):
    """The packed bytes as a numpy array: Ray keeps them in shared memory and the student
    reads them in place. CPU runs, or no better path."""

    name = "object_store"

    def send(self, topk: kd.TopK, step: int, student_rank: int) -> np.ndarray:
        return topk.pack(torch.bfloat16).cpu().numpy()

    def receive(self, message: np.ndarray, device: torch.device) -> kd.TopK:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only shared memory: we never write it
            buffer = torch.from_numpy(message)
        unpack = kd.TeacherSamples.unpack if kd.TeacherSamples.packed_in(buffer) else kd.TopK.unpack
        return unpack(buffer).to(device)  # samples come from a teacher cache of them


class _KeepsBuffers(Transfer):
    """Keeps each step's sent buffers (and whatever must outlive the call) until `release`."""

    def __init__(self):
        self._alive: dict[int, list] = {}

    def keep(self, step: int, entry) -> None:
        self._alive.setdefault(step, []).append(entry)

    def release(self, step: int) -> None:
        for done in [s for s in self._alive if s <= step]:
            for entry in self._alive.pop(done):
                self.finish(entry)

    def finish(self, entry) -> None:
        """What releasing one kept entry takes (nothing: dropping it frees it)."""


class CudaIpc(_KeepsBuffers):
    """Teacher and student share a GPU: the teacher keeps the packed CUDA buffer and sends a
    CUDA IPC handle (torch's multiprocessing reduction); the student maps the same memory,
    no copy. The teacher frees the buffer at `release` of its step."""

    name = "cuda_ipc"

    def send(self, topk: kd.TopK, step: int, student_rank: int):
        from torch.multiprocessing.reductions import reduce_tensor

        packed = topk.pack(torch.bfloat16)
        torch.cuda.current_stream().synchronize()  # the student reads it from another process
        rebuild, arguments = reduce_tensor(packed)
        self.keep(step, packed)
        return rebuild, arguments

    def receive(self, message, device: torch.device) -> kd.TopK:
        rebuild, arguments = message
        return kd.TopK.unpack(rebuild(*arguments))


class Nccl(_KeepsBuffers):
    """Teacher and student on different GPUs of one process group (teachers and students
    together; students also get a subgroup for their gradient sum). The teacher sends the
    buffer with ``isend``; the student receives it into a buffer of the size the teacher
    announced through Ray. Sends and receives of a pair happen in micro-batch order.

    NCCL creates a pair's communicator on its first send / receive and blocks both sides
    until both arrive, so `setup` exchanges one byte with every peer before any scoring:
    otherwise the teacher's first send waits for a receive the student posts only after Ray
    hands it the teacher's reply. With gloo on CPU the same protocol runs in tests."""

    name = "nccl"

    def setup(self, peers: list[int], device: torch.device, sending: bool) -> None:
        import torch.distributed as dist

        for rank in peers:
            byte = torch.zeros(1, dtype=torch.uint8, device=device)
            dist.send(byte, dst=rank) if sending else dist.recv(byte, src=rank)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def send(self, topk: kd.TopK, step: int, student_rank: int):
        import torch.distributed as dist

        packed = topk.pack(torch.bfloat16)
        work = dist.isend(packed, dst=student_rank)
        self.keep(step, (packed, work))
        return packed.numel(), dist.get_rank()

    def receive(self, message, device: torch.device) -> kd.TopK:
        import torch.distributed as dist

        nbytes, source = message
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.recv(buffer, src=source)
        return kd.TopK.unpack(buffer)

    def finish(self, entry) -> None:
        entry[1].wait()  # the send completed before its buffer is dropped


# the in-process transfer's table, shared by the teacher and the student of one process:
# key -> the TopK sent and not yet received
_IN_PROCESS: dict[int, kd.TopK] = {}
_IN_PROCESS_KEYS = itertools.count()


class InProcess(Transfer):
    """Teacher and student in one process (``placement=fused``): `send` keeps the TopK itself
    in this process's table and returns its key, `receive` pops it; no copy, no
    serialization. The log-probs are rounded to bfloat16 as every other mode sends them
    (a no-op when they are bf16 already), so the student trains on the same values. The
    teacher's `release` of a step drops what no student received (a step that failed)."""

    name = "in_process"

    def __init__(self):
        self._sent: dict[int, list[int]] = {}  # step -> keys this teacher sent

    def send(self, topk: kd.TopK, step: int, student_rank: int) -> int:
        if not isinstance(topk, kd.TopK):
            raise TypeError(f"topk: the in_process transfer sends kd.TopK, got {type(topk).__name__}")
        key = next(_IN_PROCESS_KEYS)
        _IN_PROCESS[key] = kd.TopK(topk.logprobs.to(torch.bfloat16), topk.indices.to(torch.int32),
                                   None if topk.lse is None else topk.lse.float(), topk.temperature)
        self._sent.setdefault(step, []).append(key)
        return key

    def receive(self, message: int, device: torch.device) -> kd.TopK:
        if message not in _IN_PROCESS:
            raise KeyError(f"message: top-k {message} was not sent in this process (or was received already); the "
                           "in_process transfer needs the teacher and its student in one process (placement=fused)")
        return _IN_PROCESS.pop(message).to(device)

    def release(self, step: int) -> None:
        for done in [s for s in self._sent if s <= step]:
            for key in self._sent.pop(done):
                _IN_PROCESS.pop(key, None)


TRANSFERS = {mode.name: mode for mode in (ObjectStore, CudaIpc, Nccl, InProcess)}


def transfer_for(name: str) -> Transfer:
    """A new `Transfer` of the mode ``name`` (a key of `TRANSFERS`)."""
    if name not in TRANSFERS:
        raise ValueError(f"transfer: expected one of {', '.join(map(repr, TRANSFERS))}, got {name!r}")
    return TRANSFERS[name]()
