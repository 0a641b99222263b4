"""The appended teacher schedule's per-slice step (issue #4: ≤ 64 MiB near the matmul's speed):
the epilogue matmul appended each element reaching its row's floor to the row's keys (one
atomic slot each, ops/lm_head_group_maxima.py with ``append``), storing no logits. Then one
program per row merges the slice's tile statistics into its running logsumexp and, when its
keys passed ``compact_at``, keeps those reaching their k-th largest, which becomes the floor:
the next slice appends only above it. A row whose count passed the capacity lost keys and is
flagged for the redo. State as `slice_candidates.SliceState`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .slice_candidates import compact_keys, merge_tile_statistics
from .sort_keys import value_of_key


@triton.jit
def _settle_kernel(tile_max2_ptr, tile_sum2_ptr, max2_ptr, sum2_ptr, floors_ptr, keys_ptr, counts_ptr, overflow_ptr,
                   tiles, k, capacity, compact_at, BLOCK_TILES: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    merge_tile_statistics(row, tile_max2_ptr, tile_sum2_ptr, tiles, max2_ptr, sum2_ptr, BLOCK_TILES)
    count = tl.load(counts_ptr + row)
    if count > compact_at:
        if count > capacity:  # the appends past the capacity were dropped: only a redo is exact
            tl.store(overflow_ptr + row, 1)
        kept, kth = compact_keys(keys_ptr + row * capacity, tl.minimum(count, capacity), k, BLOCK_KEYS)
        tl.store(counts_ptr + row, kept)
        # the held keys all reach the floor, so their k-th largest does: the floor only rises
        tl.store(floors_ptr + row, value_of_key(kth.to(tl.int64) << 32))


def settle_appended_keys(summaries, state, k: int, compact_at: int) -> None:
    """After a slice's appending matmul: its `RowSummaries` ``[R, tiles]`` merged into
    ``state`` (a `SliceState` of R rows), rows holding more than ``compact_at`` keys compacted
    to those reaching their k-th largest (their new floor), rows past the capacity flagged."""
    rows, tiles = summaries.tile_max2.shape
    capacity = state.keys.shape[1]
    if rows == 0:
        return
    _settle_kernel[(rows,)](
        summaries.tile_max2, summaries.tile_sum2, state.max2, state.sum2, state.floors, state.keys, state.counts,
        state.overflow, tiles, k, capacity, compact_at, BLOCK_TILES=triton.next_power_of_2(tiles),
        BLOCK_KEYS=triton.next_power_of_2(capacity), num_warps=max(1, min(8, capacity // 256)))
