"""The logits of each row's listed column groups, computed again from hidden × weight: the
listed schedule's matmul stores no logits (ops/lm_head_group_maxima.py with ``logits=None``),
and only the ~k groups per row that can hold its top-k (ops/topk_from_groups.list_groups)
are multiplied out a second time, ~k · GROUP_COLUMNS / V of the matmul's work.

The (row, listed group) pairs are grouped by group (`plan_pairs`): one program takes up to
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

# sm_90 compile with the launch's 16-byte specializations (no GPU run yet): 64 rows × 64 deep at
# 8 warps, 40 registers, loads pipelined (cp.async) over 3 stages in 36 KB of shared memory
BLOCK_ROWS = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 64
BLOCK_K = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 64
NUM_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 8


@dataclasses.dataclass
class PairPlan:
    """(row, listed group) pairs of a chunk, grouped by group. ``offsets [R]`` int64: where row
    r's pairs start in the row-major (row, listed slot) order, the order of the recomputed
    logits; ``rows`` int32, ``destinations`` int64 ``[P]``: each grouped pair's row and position
    in that order (-1: not computed, its row overflows); ``group_start [G + 1]`` int64: group
    g's pairs are ``[group_start[g], group_start[g + 1])``; ``item_group [items]`` int32 and
    ``item_end [G]`` int64: program i takes block ``i - item_end[g - 1]`` of group
    ``g = item_group[i]`` (G: nothing to do); ``overflow [R]`` bool: rows with more listed
    groups than their capacity, or whose pairs pass the budget (redo them)."""
    offsets: torch.Tensor
    rows: torch.Tensor
    destinations: torch.Tensor
    group_start: torch.Tensor
    item_group: torch.Tensor
    item_end: torch.Tensor
    overflow: torch.Tensor
    budget: int


@triton.jit
def _place_pairs_kernel(group_ids_ptr, ranks_ptr, listed_ptr, offsets_ptr, group_start_ptr, overflow_ptr,
                        rows_ptr, destinations_ptr, capacity, budget, SLOTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    listed = tl.load(listed_ptr + row)
    usable = tl.minimum(listed, capacity)
    offset = tl.load(offsets_ptr + row)
    overflows = (listed > capacity) | (offset + usable > budget)
    tl.store(overflow_ptr + row, overflows.to(tl.int8))
    for start in range(0, usable, SLOTS):
        slot = start + tl.arange(0, SLOTS)
        mine = slot < usable
        group = tl.load(group_ids_ptr + row * capacity + slot, mask=mine, other=0)
        place = tl.load(group_start_ptr + group, mask=mine, other=0) + tl.load(ranks_ptr + row * capacity + slot,
                                                                               mask=mine, other=0)
        tl.store(rows_ptr + place, row.to(tl.int32), mask=mine)
        tl.store(destinations_ptr + place, tl.where(overflows, -1, offset + slot), mask=mine)


def plan_pairs(group_ids: torch.Tensor, listed: torch.Tensor, group_counts: torch.Tensor, ranks: torch.Tensor,
               budget: int) -> PairPlan:
    """`list_groups`' group_ids and ranks ``[R, C]`` int32 (row r's first ``min(listed[r], C)``
    valid), listed ``[R]`` int32 and group_counts ``[G]`` int32; budget = the most pairs
    computed (rows past it overflow) -> `PairPlan`, on the device without a host sync: a
    counting sort by group (the ranks came from the listing's atomics), no sort of R · C keys."""
    rows, capacity = group_ids.shape
    device = group_ids.device
    counts = listed.clamp(max=capacity).long()
    offsets = torch.cumsum(counts, 0) - counts
    ends = torch.cumsum(group_counts.long(), 0)
    group_start = torch.cat([ends.new_zeros(1), ends])
    pairs = rows * capacity  # every slot: a bound of the counted pairs without a sync
    pair_rows = torch.empty(pairs, dtype=torch.int32, device=device)
    destinations = torch.empty(pairs, dtype=torch.int64, device=device)
    overflow = torch.empty(rows, dtype=torch.int8, device=device)
    if rows:
        _place_pairs_kernel[(rows,)](group_ids, ranks, listed, offsets, group_start, overflow, pair_rows, destinations,
                                     capacity, budget, SLOTS=min(256, triton.next_power_of_2(capacity)),
                                     num_warps=1 if os.environ.get("TRITON_INTERPRET") == "1" else 2)
    item_end = torch.cumsum((group_counts.long() + BLOCK_ROWS - 1) // BLOCK_ROWS, 0)
    most_items = -(-pairs // BLOCK_ROWS) + group_counts.numel()
    item_group = torch.searchsorted(item_end, torch.arange(most_items, device=device), right=True)
    return PairPlan(offsets, pair_rows, destinations, group_start, item_group.to(torch.int32), item_end,
                    overflow.bool(), budget)


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
    destinations = tl.load(destinations_ptr + pair, mask=pair < stop, other=-1)
    live = destinations >= 0  # in the block, and its row not overflowing
    rows = tl.load(pair_rows_ptr + pair, mask=live, other=0).to(tl.int64)
    columns = group * GROUP_COLUMNS + tl.arange(0, GROUP_COLUMNS)
    exists = columns < width
    accumulator = tl.zeros([BLOCK_ROWS, GROUP_COLUMNS], tl.float32)
    for step in range(0, hidden_size, BLOCK_K):
        depth = step + tl.arange(0, BLOCK_K)
        a = tl.load(hidden_ptr + rows[:, None] * stride_hidden + depth[None, :],
                    mask=live[:, None] & (depth < hidden_size)[None, :], other=0.0)
        b = tl.load(weight_ptr + columns.to(tl.int64)[:, None] * stride_weight + depth[None, :],
                    mask=exists[:, None] & (depth < hidden_size)[None, :], other=0.0)
        accumulator = tl.dot(a, tl.trans(b), accumulator, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        accumulator += tl.load(bias_ptr + columns, mask=exists, other=0.0).to(tl.float32)[None, :]
    accumulator = tl.where(exists[None, :], accumulator, float("-inf"))
    tl.store(out_ptr + destinations[:, None] * GROUP_COLUMNS + tl.arange(0, GROUP_COLUMNS)[None, :], accumulator,
             mask=live[:, None])


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
