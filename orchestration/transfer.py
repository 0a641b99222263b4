"""How a teacher's packed top-k (`kd_kernels.TopK.pack`, one buffer per micro-batch) reaches
the student that trains on it.

- ``object_store``: the teacher returns the packed bytes as a numpy array; Ray keeps them in
  shared memory and the student reads them in place. CPU runs, or no better path.
- ``cuda_ipc``: teacher and student share a GPU. The teacher keeps the packed CUDA buffer
  and returns a CUDA IPC handle (torch's multiprocessing reduction); the student maps the
  same memory: no copy at all. The teacher frees the buffer when the driver says the
  student's step is done.
- ``nccl``: teacher and student on different GPUs of one process group (teachers and
  students together; students also get a subgroup for their gradient sum). The teacher
  sends the buffer with ``isend``, the student receives it into a buffer of the size the
  teacher announced through Ray. Sends and receives of a pair happen in micro-batch order.
  NCCL creates a pair's communicator on its first send / receive and blocks both sides
  until both arrive, so the driver connects every pair (`handshake`) before any scoring:
  otherwise the teacher's first send waits for a receive the student only posts after
  Ray hands it the teacher's reply.

The message that travels through Ray is small in the last two cases (a handle or a size).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

import kd_kernels as kd

@dataclass(frozen=True)
class Layout:
    """Where the workers run and how top-k travels: resolved once by the driver."""
    placement: str  # colocated | disaggregated ("colocated" on CPU, where there is no GPU to place)
    transfer: str  # object_store | cuda_ipc | nccl
    gpus_per_teacher: float  # Ray num_gpus of each actor (0 on CPU)
    gpus_per_student: float


# per GPU placement: (its default transfer, the transfer it cannot use and why)
_GPU_TRANSFERS = {
    "disaggregated": ("nccl", "cuda_ipc", "cuda_ipc maps memory of the same GPU; disaggregated workers use nccl or "
                                          "object_store"),
    "colocated": ("cuda_ipc", "nccl", "nccl cannot connect two workers on one GPU; colocated workers use cuda_ipc or "
                                      "object_store"),
}


def resolve_layout(placement: str, transfer: str, device_type: str, gpus: int, teachers: int,
                   students: int) -> Layout:
    """The layout for the requested placement / transfer ("auto" or a name) on this machine.

    GPU: colocated (a teacher and a student worker on each GPU, CUDA IPC) when teacher_workers
    == student_workers fit the GPUs, else disaggregated (one GPU per worker, NCCL); colocated
    needs half the GPUs and was the faster of the two on two H200s (benchmarks/RESULTS.md).
    CPU: the object store. Raises for requests the machine cannot honour."""
    if device_type != "cuda":
        if transfer not in ("auto", "object_store"):
            raise ValueError(f"transfer: {transfer!r} needs CUDA devices; on CPU use object_store (or auto)")
        if placement == "disaggregated":
            raise ValueError("placement: disaggregated needs CUDA devices; on CPU use colocated (or auto)")
        return Layout("colocated", "object_store", 0.0, 0.0)
    if placement == "auto":
        placement = "colocated" if teachers == students <= gpus else "disaggregated"
    if placement == "disaggregated" and gpus < teachers + students:
        raise ValueError(f"placement: disaggregated needs one GPU per worker ({teachers} teacher + {students} "
                         f"student workers), this machine has {gpus}")
    if placement == "colocated" and (teachers != students or students > gpus):
        raise ValueError(f"placement: colocated puts one teacher and one student worker on each GPU: needs "
                         f"teacher_workers == student_workers <= GPUs, got {teachers}, {students} and {gpus} GPUs")
    default, refused, why = _GPU_TRANSFERS[placement]
    chosen = default if transfer == "auto" else transfer
    if chosen == refused:
        raise ValueError(f"transfer: {why}")
    share = 1.0 if placement == "disaggregated" else 0.5  # Ray num_gpus of each actor
    return Layout(placement, chosen, share, share)


class TopKSender:
    """Teacher side: turns a `TopK` into the message for one student and keeps what must
    stay alive (IPC buffers, pending sends) until `release` of its step."""

    def __init__(self, transfer: str):
        self.transfer = transfer
        self._alive: dict[int, list] = {}

    def send(self, topk: kd.TopK, step: int, student_rank: int) -> Any:
        packed = topk.pack(torch.bfloat16)
        if self.transfer == "object_store":
            return ("object_store", packed.cpu().numpy())
        if self.transfer == "cuda_ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            torch.cuda.current_stream().synchronize()  # the student reads it from another process
            rebuild, arguments = reduce_tensor(packed)
            self._alive.setdefault(step, []).append(packed)
            return ("cuda_ipc", rebuild, arguments)
        import torch.distributed as dist

        work = dist.isend(packed, dst=student_rank)
        self._alive.setdefault(step, []).append((packed, work))
        return ("nccl", packed.numel(), dist.get_rank())

    def release(self, step: int) -> None:
        """Drops the buffers of ``step`` and earlier (their students are done with them)."""
        for done in [s for s in self._alive if s <= step]:
            for entry in self._alive.pop(done):
                if isinstance(entry, tuple):
                    entry[1].wait()


def handshake(peer_ranks: list[int], device: torch.device, sending: bool) -> None:
    """One byte to (teacher side, ``sending``) or from (student side) each peer, in rank
    order: creates the NCCL pair communicators before any real transfer."""
    import torch.distributed as dist

    for rank in peer_ranks:
        byte = torch.zeros(1, dtype=torch.uint8, device=device)
        dist.send(byte, dst=rank) if sending else dist.recv(byte, src=rank)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def receive_topk(message, device: torch.device) -> kd.TopK:
    """Student side: the `TopK` a `TopKSender.send` message stands for, on ``device``."""
    kind = message[0]
    if kind == "object_store":
        buffer = message[1]
        if isinstance(buffer, np.ndarray):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only shared memory: we never write it
                buffer = torch.from_numpy(buffer)
        return kd.TopK.unpack(buffer).to(device)
    if kind == "cuda_ipc":
        _, rebuild, arguments = message
        return kd.TopK.unpack(rebuild(*arguments))
    if kind == "nccl":
        import torch.distributed as dist

        _, nbytes, source = message
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.recv(buffer, src=source)
        return kd.TopK.unpack(buffer)
    raise ValueError(f"message: unknown transfer {kind!r}")


def gpu_identity() -> Optional[str]:
    """This process's GPU (its UUID), or None without CUDA: lets the driver check placement."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
