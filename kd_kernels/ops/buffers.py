"""Several work tensors from one allocation: each `torch.empty` on a CUDA device is host work
on the hot path (a chunk's summaries take one), and the parts can share bytes over time (the
appended schedule's sample, then its keys)."""
from __future__ import annotations

import torch

ALIGNMENT = 16  # bytes: TMA and vectorized loads want each part's rows there


def empty_parts(device, *parts: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
    """Uninitialized contiguous tensors of the given (shape, dtype), views into one byte buffer,
    each starting at an ALIGNMENT-byte boundary. One view of the buffer a dtype, then one
    strided view a part: the fewest tensor operations (each is host time)."""
    offsets, total = [], 0
    for shape, dtype in parts:
        offsets.append(total)
        total += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGNMENT) * ALIGNMENT
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    typed = {}  # the buffer as each dtype (its size is a multiple of ALIGNMENT bytes)
    views = []
    for offset, (shape, dtype) in zip(offsets, parts):
        if dtype not in typed:
            typed[dtype] = buffer.view(dtype)
        views.append(typed[dtype].as_strided(shape, _contiguous_strides(shape), offset // dtype.itemsize))
    return views


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
