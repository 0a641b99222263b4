"""The appended schedules' first phase: each row's floor from the logits of every ``stride``-th
column (an `AppendedPlan`'s sample), for all rows before any chunk's appending matmul. The
sample is thin (V / stride columns): one matmul over many rows fills the GPU in whole waves where
one chunk's would not, and its logits live only until their rows' floors are taken."""
from __future__ import annotations

from typing import Callable

import torch

from ..ops.lm_head_group_maxima import EpilogueMatmul
from .chunks import rows_in_quarter_groups


def floors_of_rows(hidden: torch.Tensor, weight: torch.Tensor, sample_bias, width: int, plan, temperature: float,
                   budget_bytes: int, reduce: Callable[[torch.Tensor, slice, torch.Tensor], object]) -> torch.Tensor:
    """hidden ``[N, H]``, weight ``[≥ width, H]`` 16-bit, ``sample_bias`` (the bias at the sample's
    columns, or None) -> floors ``[N]`` float32: per block of rows whose sample logits fit in
    ``budget_bytes`` (whole quarters of the matmul's L2 row group, or all rows), the logits of
    columns ``0, stride, 2·stride, …`` below ``width`` (``[R, plan.sample_width]`` in the inputs'
    dtype, bias included, before τ), then ``reduce(sample, rows, floors[rows])`` fills the block's
    floors."""
    num_rows = hidden.shape[0]
    block = rows_in_quarter_groups(budget_bytes // (hidden.element_size() * plan.sample_columns), num_rows)
    floors = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
    # apart from the floors: freed before the appending matmuls' keys exist
    sample = torch.empty(min(block, num_rows), plan.sample_columns, dtype=hidden.dtype, device=hidden.device)
    columns = weight[:width:plan.stride]
    for start in range(0, num_rows, block):
        rows = slice(start, min(start + block, num_rows))
        part = _rows_of(sample, slice(0, rows.stop - rows.start))
        EpilogueMatmul(_rows_of(hidden, rows), columns, sample_bias, plan.sample_width, temperature, part,
                       summaries=False)(0, plan.sample_width)
        reduce(part[:, :plan.sample_width], rows, _rows_of(floors, rows))
    return floors


def _rows_of(tensor: torch.Tensor, rows: slice) -> torch.Tensor:
    """``tensor[rows]``, or the tensor itself where that is all of it (a view is host time, and
    this is the device's wait: the previous call ended in a sync)."""
    return tensor if rows.start == 0 and rows.stop == tensor.shape[0] else tensor[rows]
