"""Each row's top-k and logsumexp from the summaries the matmul epilogue left
(ops/lm_head_group_maxima.py), reading only ~k groups of the float32 logits row.

One program per row:
1. the logsumexp from the per-tile (max, sum of exp) in log2 units;
2. T = the k-th largest group maximum, by bisection on the float's ordered bits (exact: no
   sort). k distinct groups hold an element ≥ T, so the k-th largest logit is ≥ T, and every
   element ≥ T lies in a group whose maximum is ≥ T: the candidates are the elements ≥ T of
   those groups (~k of them on LLM logits; every tie of the k-th value among them);
   With k at most half the tiles, the k-th largest tile maximum serves the same way, found in
   fewer steps;
3. those groups' columns read, the elements ≥ T given slots in column order as one (value,
   complemented column) key each; each key goes to its rank among them (the count of larger
   keys): value descending, the lower column first among ties. No sort network: `tl.sort` of
   512 keys per row cost ~1.3 ms over 8192 rows on an H200, and 4096 keys ~8 ms.

Rows with more candidate groups or elements than ``capacity`` slots (massive ties) are flagged
for an exact redo by the caller; with fewer than k columns the missing entries are -inf at
column 0.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .sort_keys import EMPTY_COLUMN, ordered_bits, value_column_key, value_of_key

_EMPTY_COLUMN = tl.constexpr(EMPTY_COLUMN)
GROUPS_PER_STEP = 64
RANK_BLOCK = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 128
SELECT_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 4  # H200: 4 warps 1.3 ms, 2 or 8 1.7 ms (k = 64)


def capacity_for(k: int) -> int:
    """Candidate slots per row: several times the ~k a row needs on LLM logits; ranking costs
    the square of the count, so rows past it (massive ties) are redone instead."""
    return max(256, 4 * k)


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
def _threshold(block_key, valid, k):
    """The largest t (int32 ordered bits) with at least k valid block maxima ≥ t (any shape);
    the smallest int32 where fewer than k blocks are valid."""
    low = tl.full([], -2147483648, tl.int64)
    high = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        middle = low + (high - low + 1) // 2
        enough = tl.sum(((block_key >= middle.to(tl.int32)) & valid).to(tl.int32)) >= k
        low = tl.where(enough, middle, low)
        high = tl.where(enough, high, middle - 1)
    return low.to(tl.int32)


@triton.jit
def _store_in_rank_order(keys_ptr, count, values_ptr, columns_ptr, k, RANK_BLOCK: tl.constexpr):
    """The first k of ``count`` distinct keys in descending order, each at its rank (the number
    of larger keys: O(count²) compares, cheap at ~k candidates, no sort network); positions
    past ``count`` get -inf at column 0."""
    lanes = tl.arange(0, RANK_BLOCK)
    for start in range(0, k, RANK_BLOCK):
        position = start + lanes
        missing = (position >= count) & (position < k)
        tl.store(values_ptr + position, tl.full([RANK_BLOCK], float("-inf"), tl.float32), mask=missing)
        tl.store(columns_ptr + position, tl.zeros([RANK_BLOCK], tl.int32), mask=missing)
    for start in range(0, count, RANK_BLOCK):
        mine = start + lanes
        key = tl.load(keys_ptr + mine, mask=mine < count, other=0)
        rank = tl.zeros([RANK_BLOCK], tl.int32)
        for other_start in range(0, count, RANK_BLOCK):
            other = other_start + lanes
            other_key = tl.load(keys_ptr + other, mask=other < count, other=0)
            larger = (other_key[None, :] > key[:, None]) & (other < count)[None, :]
            rank += tl.sum(larger.to(tl.int32), axis=1)
        kept = (mine < count) & (rank < k)
        tl.store(values_ptr + rank, value_of_key(key), mask=kept)
        tl.store(columns_ptr + rank, (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32), mask=kept)


@triton.jit
def _topk_from_groups_kernel(logits_ptr, stride_row, tile_max2_ptr, tile_sum2_ptr, group_max_ptr, group_ids_ptr,
                             keys_ptr, values_ptr, columns_ptr, lse_ptr, overflow_ptr, tiles, width, k,
                             TILES: tl.constexpr, GROUPS_PER_TILE: tl.constexpr, GROUP_COLUMNS: tl.constexpr,
                             CAPACITY: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, RANK_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(lse_ptr + row, _row_lse(tile_max2_ptr, tile_sum2_ptr, row, tiles, TILES))

    # group maxima as [tile, group of the tile]: the global group id is their flat index
    groups = tiles * GROUPS_PER_TILE
    group = tl.arange(0, TILES)[:, None] * GROUPS_PER_TILE + tl.arange(0, GROUPS_PER_TILE)[None, :]
    valid = group < groups
    group_key = ordered_bits(tl.load(group_max_ptr + row * groups + group, mask=valid, other=0.0))
    if k <= tiles // 2:  # k tiles bound it as well as k groups (~k candidates either way), in fewer steps
        tile_key = tl.max(tl.where(valid, group_key, -2147483648), axis=1)
        threshold = _threshold(tile_key, tl.arange(0, TILES) < tiles, k)
    else:
        threshold = _threshold(group_key, valid, k)
    candidate = tl.reshape(valid & (group_key >= threshold), [TILES * GROUPS_PER_TILE])
    flat_group = tl.reshape(group, [TILES * GROUPS_PER_TILE])
    candidate_groups = tl.sum(candidate.to(tl.int32), axis=0)
    slot = tl.cumsum(candidate.to(tl.int32), axis=0) - 1
    tl.store(group_ids_ptr + row * CAPACITY + slot, flat_group, mask=candidate & (slot < CAPACITY))
    tl.debug_barrier()  # every thread's group ids are in memory

    listed = tl.minimum(candidate_groups, CAPACITY)
    lanes = tl.arange(0, GROUPS_PER_STEP * GROUP_COLUMNS)
    count = tl.zeros([], tl.int32)
    for start in range(0, listed, GROUPS_PER_STEP):
        entry = start + lanes // GROUP_COLUMNS
        in_list = entry < listed
        group_id = tl.load(group_ids_ptr + row * CAPACITY + entry, mask=in_list, other=0)
        columns = group_id * GROUP_COLUMNS + lanes % GROUP_COLUMNS
        exists = in_list & (columns < width)
        z = tl.load(logits_ptr + row * stride_row + columns, mask=exists, other=float("-inf"))
        take = exists & (ordered_bits(z) >= threshold)
        position = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(keys_ptr + row * CAPACITY + position, value_column_key(z, columns), mask=take & (position < CAPACITY))
        count += tl.sum(take.to(tl.int32), axis=0)
    tl.store(overflow_ptr + row, ((candidate_groups > CAPACITY) | (count > CAPACITY)).to(tl.int8))
    tl.debug_barrier()  # every thread's keys are in memory
    _store_in_rank_order(keys_ptr + row * CAPACITY, tl.minimum(count, CAPACITY), values_ptr + row * k,
                         columns_ptr + row * k, k, RANK_BLOCK)


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
            values, columns, lse, overflow, tiles, width, k, TILES=triton.next_power_of_2(tiles),
            GROUPS_PER_TILE=groups // tiles, GROUP_COLUMNS=summaries.group_columns, CAPACITY=capacity,
            GROUPS_PER_STEP=GROUPS_PER_STEP, RANK_BLOCK=RANK_BLOCK, num_warps=SELECT_WARPS)
    return values.div_(temperature), columns, lse, overflow.bool()
