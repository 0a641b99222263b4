"""The logits of each row's listed column groups, computed again from hidden × weight: the
listed schedule's matmul stores no logits (ops/lm_head_group_maxima.py with ``logits=None``),
and only the ~k groups per row that can hold its top-k (ops/topk_from_groups.list_groups)
are multiplied out a second time, ~k · GROUP_COLUMNS / V of the matmul's work.

The (row, listed group) pairs are sorted by group (`plan_pairs`): one program takes up to
``BLOCK_ROWS`` pairs of one group and multiplies their gathered hidden rows by the group's
``GROUP_COLUMNS`` weight rows, so a group's weights are read once per block of rows that
listed it (common tokens are listed by most rows), not once per row.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

# sm_90 compile (no GPU run yet): 64 rows × 64 deep at 8 warps, 192 registers, no spills; at
# 4 warps or 128 deep the gathered rows' 64-bit addresses take 246-255 registers and spill
BLOCK_ROWS = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 64
BLOCK_K = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 64
NUM_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 8


@dataclasses.dataclass
class PairPlan:
    """(row, listed group) pairs of a chunk, sorted by group. ``offsets [R]`` int64: where row
    r's pairs start in the row-major (row, listed slot) order, the order of the recomputed
    logits; ``rows``, ``destinations`` ``[R · C]`` (int32, int64): each sorted pair's row and
    position in that order; ``group_start [G + 1]`` int64: group g's pairs are
    ``[group_start[g], group_start[g + 1])`` of the sorted ones; ``item_group [items]`` int32
    and ``item_end [G]`` int64: program i takes block ``i - item_end[g - 1]`` of group
    ``g = item_group[i]`` (G: nothing to do); ``overflow [R]`` bool: rows whose pairs did not
    fit the budget (not computed: redo them)."""
    offsets: torch.Tensor
    rows: torch.Tensor
    destinations: torch.Tensor
    group_start: torch.Tensor
    item_group: torch.Tensor
    item_end: torch.Tensor
    overflow: torch.Tensor
    budget: int


def plan_pairs(group_ids: torch.Tensor, listed: torch.Tensor, groups: int, budget: int) -> PairPlan:
    """group_ids ``[R, C]`` int32 (row r's first ``min(listed[r], C)`` valid), listed ``[R]``
    int32, groups per row G, budget = the most pairs computed (rows past it overflow) ->
    `PairPlan`, on the device without a host sync."""
    rows, capacity = group_ids.shape
    device = group_ids.device
    counts = listed.clamp(max=capacity).long()
    ends = torch.cumsum(counts, 0)
    offsets = ends - counts
    slots = torch.arange(capacity, device=device)
    destinations = offsets[:, None] + slots[None, :]
    valid = (slots[None, :] < counts[:, None]) & (destinations < budget)
    # group in the high half, destination in the low: one sort orders by group; groups == G sort last
    keys = torch.where(valid, (group_ids.long() << 32) | destinations, groups << 32).flatten()
    keys = torch.sort(keys).values
    sorted_groups, sorted_destinations = keys >> 32, keys & 0xFFFFFFFF
    pair_rows = torch.searchsorted(ends, sorted_destinations, right=True).clamp_(max=max(rows - 1, 0))
    group_start = torch.searchsorted(sorted_groups, torch.arange(groups + 1, device=device))
    item_end = torch.cumsum((group_start[1:] - group_start[:-1] + BLOCK_ROWS - 1) // BLOCK_ROWS, 0)
    most_items = -(-min(budget, rows * capacity) // BLOCK_ROWS) + groups
    item_group = torch.searchsorted(item_end, torch.arange(most_items, device=device), right=True)
    return PairPlan(offsets, pair_rows.to(torch.int32), sorted_destinations, group_start, item_group.to(torch.int32),
                    item_end, (listed > capacity) | (ends > budget), budget)


@triton.jit
def _listed_group_logits_kernel(hidden_ptr, weight_ptr, bias_ptr, out_ptr, pair_rows_ptr, destinations_ptr,
                                group_start_ptr, item_group_ptr, item_end_ptr, groups, width, hidden_size,
                                stride_hidden, stride_weight, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                                GROUP_COLUMNS: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    item = tl.program_id(0)
    group = tl.load(item_group_ptr + item)
    if group >= groups:
        return
    first_item = tl.load(item_end_ptr + group - 1, mask=group > 0, other=0)
    start = tl.load(group_start_ptr + group) + (item - first_item) * BLOCK_ROWS
    stop = tl.load(group_start_ptr + group + 1)
    pair = start + tl.arange(0, BLOCK_ROWS)
    in_block = pair < stop
    rows = tl.load(pair_rows_ptr + pair, mask=in_block, other=0).to(tl.int64)
    columns = group * GROUP_COLUMNS + tl.arange(0, GROUP_COLUMNS)
    exists = columns < width
    accumulator = tl.zeros([BLOCK_ROWS, GROUP_COLUMNS], tl.float32)
    for step in range(0, hidden_size, BLOCK_K):
        depth = step + tl.arange(0, BLOCK_K)
        a = tl.load(hidden_ptr + rows[:, None] * stride_hidden + depth[None, :],
                    mask=in_block[:, None] & (depth < hidden_size)[None, :], other=0.0)
        b = tl.load(weight_ptr + columns.to(tl.int64)[:, None] * stride_weight + depth[None, :],
                    mask=exists[:, None] & (depth < hidden_size)[None, :], other=0.0)
        accumulator = tl.dot(a, tl.trans(b), accumulator, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        accumulator += tl.load(bias_ptr + columns, mask=exists, other=0.0).to(tl.float32)[None, :]
    accumulator = tl.where(exists[None, :], accumulator, float("-inf"))
    destinations = tl.load(destinations_ptr + pair, mask=in_block, other=0)
    tl.store(out_ptr + destinations[:, None] * GROUP_COLUMNS + tl.arange(0, GROUP_COLUMNS)[None, :], accumulator,
             mask=in_block[:, None])


def listed_group_logits(hidden: torch.Tensor, weight: torch.Tensor, bias, width: int, plan: PairPlan,
                        group_columns: int) -> torch.Tensor:
    """hidden ``[R, H]``, weight ``[≥ width, H]`` (16-bit, or float32 with IEEE products),
    bias ``[≥ width]`` or None, the chunk's `PairPlan` -> ``[budget, group_columns]`` float32:
    row ``offsets[r] + s`` holds the logits of row r's s-th listed group (-inf past ``width``;
    rows no pair reaches are left unwritten)."""
    hidden_size = hidden.shape[1]
    if hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"hidden, weight: expected contiguous rows, got strides {tuple(hidden.stride())}, "
                         f"{tuple(weight.stride())}")
    out = torch.empty(plan.budget, group_columns, dtype=torch.float32, device=hidden.device)
    items = plan.item_group.numel()
    if items:
        _listed_group_logits_kernel[(items,)](
            hidden, weight, bias if bias is not None else out, out, plan.rows, plan.destinations, plan.group_start,
            plan.item_group, plan.item_end, plan.group_start.numel() - 1, width, hidden_size, hidden.stride(0),
            weight.stride(0), HAS_BIAS=bias is not None, BLOCK_ROWS=BLOCK_ROWS, GROUP_COLUMNS=group_columns,
            BLOCK_K=BLOCK_K, DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
            num_warps=NUM_WARPS, num_stages=3)
    return out
