"""Each row's top-k among its listed groups' recomputed logits (ops/listed_group_logits.py).

One program per row. The groups were listed by the matmul's maxima (ops/topk_from_groups.
list_groups); the recomputation sums in another order, so a value may differ from the
epilogue's by a few ulps and the listing threshold is not reused as such. Instead
M = the smallest of the listed groups' recomputed maxima: at least k listed groups each hold
an element ≥ M (one per threshold block reaching T), so the k-th largest logit is ≥ M, and
the candidates are the listed elements ≥ M (the threshold's own ~k, ulps aside). An element of
an unlisted group was below T by the matmul's sums; it can pass M only within the two sums'
rounding, a tie at float32 precision. Where fewer than k blocks exist (the smallest int32
threshold) every listed element is a candidate.

The candidates are keyed (value, complemented column), ranked in the kernel up to
``RANK_MAX_K`` (topk_from_groups.store_in_rank_order) and ordered by a sort past it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .sort_keys import ordered_bits, top_of_counted_keys
from .topk_from_groups import RANK_MAX_K, RANK_TILE, append_keys, capacity_for, finish_row, listed_columns

GROUPS_PER_STEP = 16
SELECT_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 2


@triton.jit
def _topk_of_listed_kernel(group_logits_ptr, offsets_ptr, group_ids_ptr, listed_ptr, thresholds_ptr, keys_ptr,
                           counts_ptr, values_ptr, columns_ptr, overflow_ptr, width, k, capacity, budget,
                           GROUP_COLUMNS: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, RANK_ROWS: tl.constexpr,
                           RANK_COLUMNS: tl.constexpr, RANK_IN_KERNEL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    usable = tl.minimum(tl.load(listed_ptr + row), capacity)
    offset = tl.load(offsets_ptr + row)
    usable = tl.where(offset + usable > budget, 0, usable)  # not recomputed: the plan flagged the row
    row_logits = group_logits_ptr + offset * GROUP_COLUMNS
    lanes = tl.arange(0, GROUPS_PER_STEP * GROUP_COLUMNS)
    # M: the smallest listed group maximum (ordered bits), the smallest int32 without k blocks
    floor = tl.full([], 2147483647, tl.int32)
    for start in range(0, usable, GROUPS_PER_STEP):
        entry = start + tl.arange(0, GROUPS_PER_STEP)
        block = start * GROUP_COLUMNS + lanes
        z = tl.load(row_logits + block, mask=block < usable * GROUP_COLUMNS, other=float("-inf"))
        group_max = tl.max(tl.reshape(ordered_bits(z), (GROUPS_PER_STEP, GROUP_COLUMNS)), axis=1)
        floor = tl.minimum(floor, tl.min(tl.where(entry < usable, group_max, 2147483647), axis=0))
    floor = tl.where(tl.load(thresholds_ptr + row) == -2147483648, -2147483648, floor)
    count = tl.zeros([], tl.int32)
    for start in range(0, usable, GROUPS_PER_STEP):
        in_list, columns = listed_columns(group_ids_ptr + row * capacity, start, usable, lanes, GROUP_COLUMNS)
        z = tl.load(row_logits + start * GROUP_COLUMNS + lanes, mask=in_list, other=float("-inf"))
        take = in_list & (columns < width) & (ordered_bits(z) >= floor)
        count = append_keys(keys_ptr + row * capacity, count, capacity, take, z, columns)
    finish_row(row, count, count > capacity, keys_ptr, counts_ptr, overflow_ptr, values_ptr, columns_ptr, k, capacity,
               RANK_IN_KERNEL, RANK_ROWS, RANK_COLUMNS)


def topk_of_listed(group_logits: torch.Tensor, offsets: torch.Tensor, group_ids: torch.Tensor, listed: torch.Tensor,
                   thresholds: torch.Tensor, k: int, width: int, order: str = "torch"):
    """The recomputed logits ``[P, GROUP_COLUMNS]`` float32 of each row's listed groups (row
    r's from ``offsets[r]`` int64), group_ids ``[R, capacity_for(k)]`` int32, listed ``[R]``
    int32 and thresholds ``[R]`` int32 (`list_groups`) -> (values ``[R, k]`` float32 logits,
    descending, lower column first among ties, -inf past the candidates; columns ``[R, k]``
    int32, 0 there; overflow ``[R]`` bool: more candidates than capacity, redo the row).
    Past ``RANK_MAX_K`` the candidates are ordered by ``order`` ("cuda" or "torch")."""
    rows, capacity = group_ids.shape
    if capacity != capacity_for(k):
        raise ValueError(f"group_ids: expected {capacity_for(k)} slots per row for k = {k}, got {capacity}")
    device = group_logits.device
    rank_in_kernel = k <= RANK_MAX_K
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    columns = torch.empty(rows, k, dtype=torch.int32, device=device)
    overflow = torch.empty(rows, dtype=torch.int8, device=device)
    counts = torch.empty(rows, dtype=torch.int32, device=device)
    keys = torch.empty(rows, capacity, dtype=torch.int64, device=device)
    if rows:
        _topk_of_listed_kernel[(rows,)](
            group_logits, offsets, group_ids, listed, thresholds, keys, counts, values, columns, overflow, width, k,
            capacity, group_logits.shape[0], GROUP_COLUMNS=group_logits.shape[1], GROUPS_PER_STEP=GROUPS_PER_STEP,
            RANK_ROWS=RANK_TILE[0][0], RANK_COLUMNS=RANK_TILE[0][1], RANK_IN_KERNEL=rank_in_kernel,
            num_warps=SELECT_WARPS)
    if not rank_in_kernel:
        values, columns = top_of_counted_keys(keys, counts, k, order)
    return values, columns, overflow.bool()
