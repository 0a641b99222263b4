"""Several work tensors from one allocation: each `torch.empty` on a CUDA device costs the host
~5-10 µs, and the first chunk's buffers are made before its first launch, while the device waits."""
from __future__ import annotations

import functools

import torch

ALIGNMENT = 16  # bytes: TMA and vectorized loads want each part's rows there


def empty_parts(device, *parts: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
    """Uninitialized contiguous tensors of the given (shape, dtype), views into one byte buffer,
    each starting at an ALIGNMENT-byte boundary."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in parts]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGNMENT) * ALIGNMENT
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    return [buffer[offset:offset + size].view(dtype).view(shape)
            for offset, size, (shape, dtype) in zip(offsets, sizes, parts)]


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    """SMs of a CUDA device (cached: `torch.cuda.get_device_properties` is host work a call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
