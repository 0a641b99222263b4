"""The sliced teacher schedule's per-slice step (issue #4's ≤ 64 MiB target): after the epilogue
matmul wrote one vocab slice of float32 logits and its row summaries, each row merges the
slice's tile statistics into its running logsumexp and appends the slice's elements that reach
its running floor (a lower bound of the row's k-th largest logit) to its candidate keys. When
the keys would pass their capacity, the row keeps only those reaching the k-th largest value of
its keys and the new elements, which becomes its floor. Only groups whose maximum reaches the
floor are read. One ranking of the few survivors ends the row (`sort_keys.top_of_counted_keys`).

State per row: running max2 / sum2 (log2 units at τ, as `RowSummaries`), floor (a logit before
τ), keys ``[R, capacity]`` int64, count, overflow (massive ties past the capacity: redo).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .sort_keys import ordered_bits, value_of_key
from .topk_from_groups import append_keys, kth_largest_bits


# columns a program reads at a time, and its warps (a module attribute, set by the parts bench)
BLOCK_COLUMNS = 128
WARPS = 1


def slice_key_capacity(k: int) -> int:
    """Candidate keys a row holds: room for ~3k new ones between two compactions to k (fewer
    compactions), a power of two (the compaction's block)."""
    return max(64, triton.next_power_of_2(4 * k))


@dataclass
class SliceState:
    """The running state of rows across vocab slices (see the module docstring)."""
    max2: torch.Tensor
    sum2: torch.Tensor
    floors: torch.Tensor
    keys: torch.Tensor
    counts: torch.Tensor
    overflow: torch.Tensor

    @classmethod
    def empty(cls, rows: int, capacity: int, device) -> "SliceState":
        return cls(torch.full((rows,), float("-inf"), device=device), torch.zeros(rows, device=device),
                   torch.full((rows,), float("-inf"), device=device),
                   torch.empty(rows, capacity, dtype=torch.int64, device=device),
                   torch.zeros(rows, dtype=torch.int32, device=device),
                   torch.zeros(rows, dtype=torch.int8, device=device))


@triton.jit
def merge_tile_statistics(row, tile_max2_ptr, tile_sum2_ptr, tiles, max2_ptr, sum2_ptr, BLOCK_TILES: tl.constexpr):
    """A row's running max2 / sum2 merged in place with a slice's ``tiles`` tile statistics."""
    tile = tl.arange(0, BLOCK_TILES)
    tile_max2 = tl.load(tile_max2_ptr + row * tiles + tile, mask=tile < tiles, other=float("-inf"))
    tile_sum2 = tl.load(tile_sum2_ptr + row * tiles + tile, mask=tile < tiles, other=0.0)
    running_max2 = tl.load(max2_ptr + row)
    merged_max2 = tl.maximum(running_max2, tl.max(tile_max2, axis=0))
    # an all -inf row so far keeps sum 0 (-inf - -inf would make NaN)
    anchor = tl.where(merged_max2 == float("-inf"), 0.0, merged_max2)
    merged_sum2 = (tl.load(sum2_ptr + row) * tl.exp2(running_max2 - anchor)
                   + tl.sum(tile_sum2 * tl.exp2(tile_max2 - anchor), axis=0))
    tl.store(max2_ptr + row, merged_max2)
    tl.store(sum2_ptr + row, merged_sum2)


@triton.jit
def compact_keys(row_keys_ptr, count, k, BLOCK_KEYS: tl.constexpr, new_values, new_valid):
    """A row's first ``count`` keys reduced in place to those reaching t, the k-th largest value
    among them and the new elements ``new_values`` where ``new_valid`` -> (the count kept, t's
    ordered bits). The caller orders earlier stores to the keys first."""
    slot = tl.arange(0, BLOCK_KEYS)
    held = slot < count
    keys = tl.load(row_keys_ptr + slot, mask=held, other=0)
    held_bits = (keys >> 32).to(tl.int32)
    kth = kth_largest_bits(held_bits, held, k, ordered_bits(new_values), new_valid)
    kept = held & (held_bits >= kth)
    position = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # every held key is read before any is moved down
    tl.store(row_keys_ptr + position, keys, mask=kept)
    return tl.sum(kept.to(tl.int32), axis=0), kth


@triton.jit
def _slice_candidates_kernel(logits_ptr, logits_stride, tile_max2_ptr, tile_sum2_ptr, group_max_ptr, max2_ptr,
                             sum2_ptr, floors_ptr, keys_ptr, counts_ptr, overflow_ptr, tiles, groups, width,
                             column_start, k, capacity, GROUP_COLUMNS: tl.constexpr, BLOCK_TILES: tl.constexpr,
                             BLOCK_COLUMNS: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    merge_tile_statistics(row, tile_max2_ptr, tile_sum2_ptr, tiles, max2_ptr, sum2_ptr, BLOCK_TILES)
    floor = tl.load(floors_ptr + row)
    count = tl.load(counts_ptr + row)
    overflowed = tl.load(overflow_ptr + row)
    row_keys_ptr = keys_ptr + row * capacity
    # the maximum of each block of the slice, from its groups' (one load): past the first slices
    # most blocks of a row hold nothing reaching the floor, and skipping them skips their loads
    groups_per_block: tl.constexpr = BLOCK_COLUMNS // GROUP_COLUMNS
    group = tl.arange(0, BLOCK_GROUPS)
    row_group_max = tl.load(group_max_ptr + row * groups + group, mask=group < groups, other=float("-inf"))
    block_max = tl.max(tl.reshape(row_group_max, (BLOCK_GROUPS // groups_per_block, groups_per_block)), axis=1)
    block_ids = tl.arange(0, BLOCK_GROUPS // groups_per_block)
    # a block of the slice at a time, each taken as its own smaller slice: a thread's share of a
    # block bounds the registers, and a few programs a multiprocessor hide each other's latency
    for block_start in range(0, width, BLOCK_COLUMNS):
        this_block_max = tl.max(tl.where(block_ids == block_start // BLOCK_COLUMNS, block_max, float("-inf")), axis=0)
        # the floor only rises within the row, so a block below it now stays below it
        if this_block_max >= floor:
            floor, count, overflowed = _take_block(
                logits_ptr + row * logits_stride, group_max_ptr + row * groups, row_keys_ptr, block_start, width,
                column_start, k, capacity, floor, count, overflowed, GROUP_COLUMNS, BLOCK_COLUMNS, BLOCK_KEYS)
    tl.store(floors_ptr + row, floor)
    tl.store(counts_ptr + row, count)
    tl.store(overflow_ptr + row, overflowed)


@triton.jit
def _take_block(row_logits_ptr, row_group_max_ptr, row_keys_ptr, block_start, width, column_start, k, capacity, floor,
                count, overflowed, GROUP_COLUMNS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr,
                BLOCK_KEYS: tl.constexpr):
    """One block of a row's slice appended to its keys (compacted first when they would pass
    their capacity) -> the row's (floor, count, overflow flag)."""
    column = block_start + tl.arange(0, BLOCK_COLUMNS)
    inside = column < width
    group_max = tl.load(row_group_max_ptr + column // GROUP_COLUMNS, mask=inside, other=float("-inf"))
    listed = inside & (group_max >= floor)
    values = tl.load(row_logits_ptr + column, mask=listed, other=float("-inf"))
    take = listed & (values >= floor)
    new_count = tl.sum(take.to(tl.int32), axis=0)
    if new_count > 0:  # a block whose maximum reached the floor may still take nothing
        if count + new_count > capacity:  # keep what reaches the k-th largest of the keys and the new ones
            tl.debug_barrier()  # an earlier block's appends (other threads') land before they are read
            count, kth = compact_keys(row_keys_ptr, count, k, BLOCK_KEYS, values, take)
            floor = value_of_key(kth.to(tl.int64) << 32)
            take = take & (values >= floor)
        count = append_keys(row_keys_ptr, count, capacity, take, values, column_start + column)
        overflowed = overflowed | (count > capacity).to(tl.int8)
        count = tl.minimum(count, capacity)
    return floor, count, overflowed


def append_slice_candidates(logits: torch.Tensor, summaries, state: SliceState, width: int, column_start: int,
                            k: int) -> None:
    """One vocab slice: logits ``[R, ≥ width]`` float32 (this slice's columns, the first at
    global id ``column_start``) and their `RowSummaries` -> ``state`` updated in place."""
    rows, tiles = summaries.tile_max2.shape
    capacity = state.keys.shape[1]
    if rows == 0:
        return
    block_columns = max(summaries.group_columns, min(BLOCK_COLUMNS, triton.next_power_of_2(width)))
    if block_columns % summaries.group_columns:
        raise ValueError(f"BLOCK_COLUMNS: a multiple of the summaries' {summaries.group_columns}-column groups, "
                         f"got {block_columns}")
    groups = summaries.group_max.shape[1]
    block_groups = max(triton.next_power_of_2(groups), block_columns // summaries.group_columns)
    _slice_candidates_kernel[(rows,)](
        logits, logits.stride(0), summaries.tile_max2, summaries.tile_sum2, summaries.group_max, state.max2,
        state.sum2, state.floors, state.keys, state.counts, state.overflow, tiles, groups,
        width, column_start, k, capacity, GROUP_COLUMNS=summaries.group_columns,
        BLOCK_TILES=triton.next_power_of_2(tiles), BLOCK_COLUMNS=block_columns,
        BLOCK_KEYS=triton.next_power_of_2(capacity), BLOCK_GROUPS=block_groups, num_warps=WARPS)
