"""Where the workers run: the device, the GPUs, the placement of teacher and student
workers on them and the transfer that placement allows. Torch is imported only when the
machine may have a CUDA device, so a CPU machine refuses a bad layout without loading it."""
from __future__ import annotations

import glob
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Layout:
    """Where the workers run and how top-k travels: resolved once by the driver."""
    placement: str  # colocated | disaggregated | fused ("colocated" on CPU unless fused was asked for)
    transfer: str  # object_store | cuda_ipc | nccl | in_process
    gpus_per_teacher: float  # Ray num_gpus of each actor (0 on CPU; fused: of the one actor of a pair)
    gpus_per_student: float


# per GPU placement: (its default transfer, the transfer it cannot use and why)
_GPU_TRANSFERS = {
    "disaggregated": ("nccl", "cuda_ipc", "cuda_ipc maps memory of the same GPU; disaggregated workers use nccl or "
                                          "object_store"),
    "colocated": ("cuda_ipc", "nccl", "nccl cannot connect two workers on one GPU; colocated workers use cuda_ipc or "
                                      "object_store"),
}
# Device files of the GPU drivers torch can use (NVIDIA, ROCm, WSL): without any of them
# torch.cuda.is_available() is False, and torch (seconds to import) need not be asked.
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch on a machine with no GPU driver."""
    if not any(glob.glob(pattern) for pattern in _GPU_DEVICE_FILES):
        return False
    import torch

    return torch.cuda.is_available()


def gpu_count() -> int:
    if not cuda_available():
        return 0
    import torch

    return torch.cuda.device_count()


def device_type(device: str) -> str:
    """"cpu" or "cuda" for the device option (auto | cpu | cuda)."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device


def resolve_layout(placement: str, transfer: str, device: str, gpus: int, teachers: int, students: int,
                   fused_allowed: bool = False) -> Layout:
    """The layout for the requested placement / transfer ("auto" or a name) on this machine.

    GPU, when teacher_workers == student_workers fit the GPUs: fused (each teacher / student
    pair in one process on its GPU, top-k handed over in process) when ``fused_allowed`` (the
    run is off-policy from a live teacher) and the transfer is auto or in_process, else
    colocated (a teacher and a student worker on each GPU, CUDA IPC); otherwise disaggregated
    (one GPU per worker, NCCL). CPU: colocated by the object store (fused only when asked for).
    Raises ValueError for requests the machine cannot honour, naming the option."""
    if placement == "auto" and device == "cuda" and fused_allowed and transfer in ("auto", "in_process") \
            and teachers == students <= gpus:
        placement = "fused"
    if placement == "fused":
        return _fused_layout(transfer, device, gpus, teachers, students)
    if transfer == "in_process":
        raise ValueError("transfer: 'in_process' hands top-k over inside one process; it needs placement=fused")
    if device != "cuda":
        if transfer not in ("auto", "object_store"):
            raise ValueError(f"transfer: {transfer!r} needs CUDA devices; on CPU use object_store (or auto)")
        if placement == "disaggregated":
            raise ValueError("placement: 'disaggregated' needs CUDA devices; on CPU use colocated (or auto)")
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


def _fused_layout(transfer: str, device: str, gpus: int, teachers: int, students: int) -> Layout:
    if teachers != students:
        raise ValueError(f"placement: fused holds one teacher and one student worker in each process: needs "
                         f"teacher_workers == student_workers, got {teachers} and {students}")
    if device == "cuda" and students > gpus:
        raise ValueError(f"placement: fused takes one GPU per teacher / student pair: needs student_workers <= GPUs, "
                         f"got {students} and {gpus} GPUs")
    if transfer not in ("auto", "in_process"):
        raise ValueError(f"transfer: placement fused hands top-k over inside its process: use in_process (or auto), "
                         f"got {transfer!r}")
    share = 1.0 if device == "cuda" else 0.0  # the pair's one actor holds the GPU
    return Layout("fused", "in_process", share, share)


def check_placement(layout: Layout, teacher_gpus: list, student_gpus: list) -> None:
    """Colocated pairs must share a GPU (CUDA IPC maps its memory); disaggregated workers must
    not; a fused pair is one process."""
    if layout.placement in ("colocated", "fused"):
        if teacher_gpus != student_gpus:
            raise RuntimeError(f"placement {layout.placement}: Ray put teacher and student workers on different GPUs "
                               f"(teachers {teacher_gpus}, students {student_gpus})")
    elif len(set(teacher_gpus + student_gpus)) != len(teacher_gpus) + len(student_gpus):
        raise RuntimeError(f"placement disaggregated: workers share GPUs (teachers {teacher_gpus}, students "
                           f"{student_gpus})")


def gpu_identity() -> Optional[str]:
    """This process's GPU (its UUID), or None without CUDA: lets the driver check placement."""
    if not cuda_available():
        return None
    import torch

    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

