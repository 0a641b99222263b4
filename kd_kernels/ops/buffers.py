"""Several work tensors from one allocation: each `torch.empty` on a CUDA device is host work
on the hot path (a chunk's summaries take one), and the parts can share bytes over time (the
appended schedule's sample, then its keys)."""
from __future__ import annotations

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

