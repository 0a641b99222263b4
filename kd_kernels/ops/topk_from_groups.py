"""Each row's top-k and logsumexp from the summaries the matmul epilogue left
(ops/lm_head_group_maxima.py), reading only ~k groups of the float32 logits row.

One program per row:
1. the logsumexp from the per-tile (max, sum of exp) in log2 units;
2. T = the k-th largest group maximum, by bisection on the float's ordered bits (exact: no
   sort). k distinct groups hold an element ≥ T, so the k-th largest logit is ≥ T, and every
   element ≥ T lies in a group whose maximum is ≥ T: the candidates are the elements ≥ T of
   those groups (~k of them on LLM logits; every tie of the k-th value among them);
3. those groups' columns read, the elements ≥ T given slots in column order, one sort of a
   (value, complemented column) key: value descending, the lower column first among ties.

Rows with more candidate groups or elements than ``capacity`` slots (massive ties) are flagged
for an exact redo by the caller; with fewer than k columns the missing entries are -inf at
column 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import GROUPS_MIN_CAPACITY
from .sort_keys import EMPTY_COLUMN, ordered_bits, value_column_key, value_of_key

_EMPTY_COLUMN = tl.constexpr(EMPTY_COLUMN)
GROUPS_PER_STEP = 64


def capacity_for(k: int) -> int:
    """Candidate slots per row: several times k (a power of two: `tl.sort`)."""
    return max(GROUPS_MIN_CAPACITY, triton.next_power_of_2(4 * k))


@triton.jit
def _row_lse(tile_max2_ptr, tile_sum2_ptr, row, tiles, TILES: tl.constexpr):
    """The row's logsumexp at τ (natural log) from its tiles' max and sum of exp (log2 units)."""
    t = tl.arange(0, TILES)
    tile_max2 = tl.load(tile_max2_ptr + row * tiles + t, mask=t < tiles, other=float("-inf"))
    tile_sum2 = tl.load(tile_sum2_ptr + row * tiles + t, mask=t < tiles, other=0.0)
    row_max2 = tl.max(tile_max2, axis=0)
    safe_max2 = tl.where(row_max2 == float("-inf"), 0.0, row_max2)
    total = tl.sum(tile_sum2 * tl.exp2(tile_max2 - safe_max2), axis=0)
    return tl.where(row_max2 == float("-inf"), float("-inf"), (safe_max2 + tl.log2(total)) * 0.6931471805599453)


@triton.jit
def _group_threshold(group_key, valid, k):
    """The largest t (int32 ordered bits) with at least k valid group keys ≥ t; the smallest
    int32 where fewer than k groups are valid."""
    low = tl.full([], -2147483648, tl.int64)
    high = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        middle = low + (high - low + 1) // 2
        enough = tl.sum(((group_key >= middle.to(tl.int32)) & valid).to(tl.int32), axis=0) >= k
        low = tl.where(enough, middle, low)
        high = tl.where(enough, high, middle - 1)
    return low.to(tl.int32)


@triton.jit
def _topk_from_groups_kernel(logits_ptr, stride_row, tile_max2_ptr, tile_sum2_ptr, group_max_ptr, group_ids_ptr,
                             keys_ptr, values_ptr, columns_ptr, lse_ptr, overflow_ptr, tiles, groups, width, k,
                             TILES: tl.constexpr, GROUPS: tl.constexpr, GROUP_COLUMNS: tl.constexpr,
                             CAPACITY: tl.constexpr, GROUPS_PER_STEP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(lse_ptr + row, _row_lse(tile_max2_ptr, tile_sum2_ptr, row, tiles, TILES))

    g = tl.arange(0, GROUPS)
    valid = g < groups
    group_key = ordered_bits(tl.load(group_max_ptr + row * groups + g, mask=valid, other=0.0))
    threshold = _group_threshold(group_key, valid, k)
    candidate = valid & (group_key >= threshold)
    candidate_groups = tl.sum(candidate.to(tl.int32), axis=0)
    slot = tl.cumsum(candidate.to(tl.int32), axis=0) - 1
    tl.store(group_ids_ptr + row * CAPACITY + slot, g, mask=candidate & (slot < CAPACITY))
    tl.debug_barrier()  # every thread's group ids are in memory

    listed = tl.minimum(candidate_groups, CAPACITY)
    lanes = tl.arange(0, GROUPS_PER_STEP * GROUP_COLUMNS)
    count = tl.zeros([], tl.int32)
    for start in range(0, listed, GROUPS_PER_STEP):
        entry = start + lanes // GROUP_COLUMNS
        in_list = entry < listed
        group = tl.load(group_ids_ptr + row * CAPACITY + entry, mask=in_list, other=0)
        columns = group * GROUP_COLUMNS + lanes % GROUP_COLUMNS
        exists = in_list & (columns < width)
        z = tl.load(logits_ptr + row * stride_row + columns, mask=exists, other=float("-inf"))
        take = exists & (ordered_bits(z) >= threshold)
        position = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(keys_ptr + row * CAPACITY + position, value_column_key(z, columns), mask=take & (position < CAPACITY))
        count += tl.sum(take.to(tl.int32), axis=0)
    tl.store(overflow_ptr + row, ((candidate_groups > CAPACITY) | (count > CAPACITY)).to(tl.int8))
    tl.debug_barrier()  # every thread's keys are in memory

    positions = tl.arange(0, CAPACITY)
    empty = value_column_key(tl.full([CAPACITY], float("-inf"), tl.float32), tl.full([CAPACITY], _EMPTY_COLUMN, tl.int32))
    keys = tl.load(keys_ptr + row * CAPACITY + positions, mask=positions < count, other=0)
    keys = tl.sort(tl.where(positions < count, keys, empty), descending=True)
    top_columns = (0xFFFFFFFF - (keys & 0xFFFFFFFF)).to(tl.int32)
    wanted = positions < k
    tl.store(values_ptr + row * k + positions, value_of_key(keys), mask=wanted)
    tl.store(columns_ptr + row * k + positions, tl.where(top_columns == _EMPTY_COLUMN, 0, top_columns), mask=wanted)


def topk_from_group_maxima(logits: torch.Tensor, summaries, k: int, temperature: float, width: int):
    """logits ``[R, ≥ width]`` float32 and their `RowSummaries` -> (values ``[R, k]`` float32 =
    top logits / τ, descending, lower column first among ties, -inf past ``width``; columns
    ``[R, k]`` int32, 0 there; lse ``[R]`` float32 at τ; overflow ``[R]`` bool: rows to redo
    exactly, whose other outputs are meaningless)."""
    rows = logits.shape[0]
    device = logits.device
    tiles = summaries.tile_max2.shape[1]
    groups = summaries.group_max.shape[1]
    capacity = capacity_for(k)
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    columns = torch.empty(rows, k, dtype=torch.int32, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    overflow = torch.empty(rows, dtype=torch.int8, device=device)
    if rows:
        group_ids = torch.empty(rows, capacity, dtype=torch.int32, device=device)
        keys = torch.empty(rows, capacity, dtype=torch.int64, device=device)
        _topk_from_groups_kernel[(rows,)](
            logits, logits.stride(0), summaries.tile_max2, summaries.tile_sum2, summaries.group_max, group_ids, keys,
            values, columns, lse, overflow, tiles, groups, width, k,
            TILES=triton.next_power_of_2(tiles), GROUPS=triton.next_power_of_2(groups),
            GROUP_COLUMNS=summaries.group_columns, CAPACITY=capacity, GROUPS_PER_STEP=GROUPS_PER_STEP,
            num_warps=1 if device.type != "cuda" else 8)
    return values.div_(temperature), columns, lse, overflow.bool()
