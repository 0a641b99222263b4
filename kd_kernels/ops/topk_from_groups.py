"""Each row's top-k and logsumexp from the summaries the matmul epilogue left
(ops/lm_head_group_maxima.py), reading only ~k groups of the float32 logits row.

One program per row:
1. the logsumexp from the per-tile (max, sum of exp) in log2 units;
2. T = the k-th largest maximum of blocks of adjacent groups (whole tiles where there are at
   least 2k of them, else fewer groups per block), by bisection on the float's ordered bits
   (exact: no sort). k distinct blocks hold an element ≥ T, so the k-th largest logit is ≥ T,
   and every element ≥ T lies in a group whose maximum is ≥ T: the candidates are the elements
   ≥ T of those groups (~k of them on LLM logits; every tie of the k-th value among them);
3. those groups' columns read, the elements ≥ T given slots in column order as one (value,
   complemented column) key each, and each key stored at its rank among them (the count of
   larger keys: value descending, the lower column first among ties). No sort network in the
   kernel: `tl.sort` of 512 keys per row cost ~1.3 ms over 8192 rows on an H200, and of 4096
   keys ~8 ms. For k > ``RANK_MAX_K`` the rank's count² compares cost more than a sort: the
   keys are ordered after the kernel, by the CUDA extension's bitonic sort per row
   (``order="cuda"``) or one torch sort (``order="torch"``).

The kernel holds few values per thread: the whole row's group maxima in registers at once
(with their ids and masks) spilled and cost more than the rest together.

Rows with more candidate groups or elements than ``capacity`` slots (massive ties) are flagged
for an exact redo by the caller; with fewer than k columns the missing entries are -inf at
column 0.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .lm_head_group_maxima import top2_group_columns
from .sort_keys import ordered_bits, top_of_counted_keys, value_column_key, value_of_key

# groups whose columns one step reads, group maxima per step of the listing: (k <= tiles / 2,
# larger k); larger k lists ~k groups, so wider steps (fewer dependent prefix sums) at 8 warps
GROUPS_PER_STEP = (16, 64)
GROUP_BLOCK = (512, 2048)
SELECT_STAGES = 4  # fewer: the profiling stops of the kernel (benchmarks/teacher_epilogue_parts.py)
# larger k: the keys are ordered outside the kernel (a CUDA bitonic sort per row, or a torch
# sort) instead of by rank, which costs count²: the whole selection at k = 1024 over 8192 rows
# (H200) 5.5-6.4 ms ranked, 4.0-4.4 ms with a torch sort, 3.4-3.5 ms with the CUDA sort (cutting
# the ~1.3k candidates to k first by bisection cost more than it saved: 3.9 / 4.5 ms)
RANK_MAX_K = 256
LOG2E = 1.4426950408889634
# order="cuda" past RANK_MAX_K: the listed groups' candidates gathered and sorted by the
# extension (csrc/candidates_from_groups.cu, a block per row, a warp per group) instead of
# gathered here and sorted there: H200, k = 1024, 8192 rows, 2.4 ms against 4.3 in one run
GATHER_IN_CUDA = True
# keys ranked at once × keys compared against at a time: (small k at 2 warps, large k at 8)
RANK_TILE = ((16, 64), (16, 64)) if os.environ.get("TRITON_INTERPRET") == "1" else ((8, 64), (32, 64))
# warps per row program: registers bound the occupancy (sm_90 compile, a thread: 64 registers
# with 2 warps, 40 with 4 at k <= tiles / 2, H200 0.69 / 0.82 ms over 8192 rows at k = 64; for
# the [blocks, merge] maxima of larger k 99 with 8 warps, 156 with 4)
SELECT_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 2
SELECT_WARPS_LARGE_K = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 8


def threshold_merge(k: int, groups: int, groups_per_tile: int) -> int:
    """Adjacent groups per block of the threshold: as many as leave at least 2k blocks (a
    whole tile: the tile maxima, already loaded for the lse; one group: however few there are)."""
    merge = groups_per_tile
    while merge > 1 and groups // merge < 2 * k:
        merge //= 2
    return merge


def capacity_for(k: int) -> int:
    """Candidate slots per row: several times the ~k a row needs on LLM logits (ranking costs
    the square of the count, not of the slots; rows past it, massive ties, are redone)."""
    return max(256, 4 * k) if k <= 256 else 2 * k


@triton.jit
def kth_largest_bits(block_key, valid, k, other_key=None, other_valid=None):
    """The largest t (int32 ordered bits) with at least k valid keys ≥ t in ``block_key`` (any
    shape) and, when given, ``other_key``; the smallest int32 where fewer than k are valid."""
    low = tl.full([], -2147483648, tl.int64)
    high = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        middle = low + (high - low + 1) // 2
        reaching = tl.sum(((block_key >= middle.to(tl.int32)) & valid).to(tl.int32))
        if other_key is not None:
            reaching += tl.sum(((other_key >= middle.to(tl.int32)) & other_valid).to(tl.int32))
        enough = reaching >= k
        low = tl.where(enough, middle, low)
        high = tl.where(enough, high, middle - 1)
    return low.to(tl.int32)


@triton.jit
def listed_columns(row_group_ids_ptr, start, usable, lanes, GROUP_COLUMNS: tl.constexpr,
                   INTERLEAVED: tl.constexpr = False):
    """(in the list, column) of each lane of the step reading listed groups ``start, …`` of a
    row (``GROUP_COLUMNS`` lanes a group; ``usable`` groups listed; groups of a ``group_top2``
    matmul where ``INTERLEAVED``, else runs of columns)."""
    entry = start + lanes // GROUP_COLUMNS
    in_list = entry < usable
    group = tl.load(row_group_ids_ptr + entry, mask=in_list, other=0)
    if INTERLEAVED:
        return in_list, top2_group_columns(group, lanes % GROUP_COLUMNS, GROUP_COLUMNS)
    return in_list, group * GROUP_COLUMNS + lanes % GROUP_COLUMNS


@triton.jit
def append_keys(row_keys_ptr, count, capacity, take, values, columns):
    """The taken (value, column) keys stored at a row's next slots, in lane order (those past
    ``capacity`` dropped: the caller flags the row); returns the new count, which may pass it."""
    position = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(row_keys_ptr + position, value_column_key(values, columns), mask=take & (position < capacity))
    return count + tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def store_in_rank_order(keys_ptr, count, values_ptr, columns_ptr, k, RANK_ROWS: tl.constexpr,
                         RANK_COLUMNS: tl.constexpr):
    """The first k of ``count`` distinct keys in descending order, each at its rank (the number
    of larger keys: O(count²) compares, cheap at ~k candidates, no sort network), RANK_ROWS keys
    against RANK_COLUMNS others at a time (a small tile: registers bound the kernel's
    occupancy); positions past ``count`` get -inf at column 0."""
    fill = tl.arange(0, RANK_COLUMNS)
    for start in range(0, k, RANK_COLUMNS):
        position = start + fill
        missing = (position >= count) & (position < k)
        tl.store(values_ptr + position, tl.full([RANK_COLUMNS], float("-inf"), tl.float32), mask=missing)
        tl.store(columns_ptr + position, tl.zeros([RANK_COLUMNS], tl.int32), mask=missing)
    for start in range(0, count, RANK_ROWS):
        mine = start + tl.arange(0, RANK_ROWS)
        key = tl.load(keys_ptr + mine, mask=mine < count, other=0)
        # counted per lane, summed once: a reduction across threads per step (barriers) made
        # k = 1024 cost 17 ms over 8192 rows on an H200
        larger = tl.zeros([RANK_ROWS, RANK_COLUMNS], tl.int32)
        for other_start in range(0, count, RANK_COLUMNS):
            other = other_start + fill
            other_key = tl.load(keys_ptr + other, mask=other < count, other=-9223372036854775807 - 1)
            larger += (other_key[None, :] > key[:, None]).to(tl.int32)
        rank = tl.sum(larger, axis=1)
        kept = (mine < count) & (rank < k)
        tl.store(values_ptr + rank, value_of_key(key), mask=kept)
        tl.store(columns_ptr + rank, (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32), mask=kept)


@triton.jit
def finish_row(row, count, overflowed, keys_ptr, counts_ptr, overflow_ptr, values_ptr, columns_ptr, k, capacity,
               RANK_IN_KERNEL: tl.constexpr, RANK_ROWS: tl.constexpr, RANK_COLUMNS: tl.constexpr):
    """A row's overflow flag and candidate count (at most ``capacity``) stored, and with
    RANK_IN_KERNEL its first k keys in order into values and columns."""
    tl.store(overflow_ptr + row, overflowed.to(tl.int8))
    count = tl.minimum(count, capacity)
    tl.store(counts_ptr + row, count)
    if RANK_IN_KERNEL:
        tl.debug_barrier()  # every thread's keys are in memory
        store_in_rank_order(keys_ptr + row * capacity, count, values_ptr + row * k, columns_ptr + row * k, k,
                            RANK_ROWS, RANK_COLUMNS)


@triton.jit
def row_logsumexp(tile_max2_ptr, tile_sum2_ptr, lse_ptr, row, tiles, TILES: tl.constexpr):
    """The row's logsumexp at τ (natural units) stored from its tiles' (max, sum of exp) in
    log2 units; returns the tile maxima ``[TILES]`` (-inf past ``tiles``)."""
    t = tl.arange(0, TILES)
    tile_max2 = tl.load(tile_max2_ptr + row * tiles + t, mask=t < tiles, other=float("-inf"))
    tile_sum2 = tl.load(tile_sum2_ptr + row * tiles + t, mask=t < tiles, other=0.0)
    row_max2 = tl.max(tile_max2, axis=0)
    safe_max2 = tl.where(row_max2 == float("-inf"), 0.0, row_max2)
    total = tl.sum(tile_sum2 * tl.exp2(tile_max2 - safe_max2), axis=0)
    tl.store(lse_ptr + row, tl.where(row_max2 == float("-inf"), float("-inf"),
                                     (safe_max2 + tl.log2(total)) * 0.6931471805599453))
    return tile_max2


@triton.jit
def group_threshold(tile_max2, group_row, groups, tiles, k, log2e_over_t, TILES: tl.constexpr,
                    THRESHOLD_BLOCKS: tl.constexpr, MERGE: tl.constexpr, GROUPS_PER_TILE: tl.constexpr):
    """T: the ordered bits of the k-th largest maximum of blocks of MERGE adjacent groups, in
    the epilogue's units z · log2e / τ (rounding is monotone, so an element below it in those
    units is below k others in value, and the k-th is never left out); the smallest int32
    where fewer than k blocks exist."""
    if MERGE == GROUPS_PER_TILE:  # the k-th largest tile maximum (tiles are in registers already)
        threshold = kth_largest_bits(ordered_bits(tile_max2), tl.arange(0, TILES) < tiles, k)
    else:  # the k-th largest maximum of MERGE adjacent groups: ≥ 2k such blocks, ~k candidates
        block = tl.arange(0, THRESHOLD_BLOCKS)[:, None] * MERGE + tl.arange(0, MERGE)[None, :]
        block_max = tl.max(tl.load(group_row + block, mask=block < groups, other=float("-inf")), axis=1)
        threshold = kth_largest_bits(ordered_bits(block_max * log2e_over_t),
                                     tl.arange(0, THRESHOLD_BLOCKS) * MERGE < groups, k)
    return threshold


@triton.jit
def list_reaching_groups(group_row, groups, threshold, log2e_over_t, row_group_ids_ptr, capacity,
                         GROUP_BLOCK: tl.constexpr):
    """The ids of the groups whose maximum reaches ``threshold``, in column order, into the
    row's first slots (those past ``capacity`` dropped); returns how many reach it."""
    listed = tl.zeros([], tl.int32)
    block = tl.arange(0, GROUP_BLOCK)
    for start in range(0, groups, GROUP_BLOCK):
        group = start + block
        block_max2 = tl.load(group_row + group, mask=group < groups, other=0.0) * log2e_over_t
        candidate = (group < groups) & (ordered_bits(block_max2) >= threshold)
        slot = listed + tl.cumsum(candidate.to(tl.int32), axis=0) - 1
        tl.store(row_group_ids_ptr + slot, group, mask=candidate & (slot < capacity))
        listed += tl.sum(candidate.to(tl.int32), axis=0)
    return listed


@triton.jit
def _topk_from_groups_kernel(logits_ptr, stride_row, tile_max2_ptr, tile_sum2_ptr, group_max_ptr, group_ids_ptr,
                             thresholds_ptr, keys_ptr, counts_ptr, values_ptr,
                             columns_ptr, lse_ptr, overflow_ptr, tiles, width, k, capacity, log2e_over_t,
                             TILES: tl.constexpr,
                             THRESHOLD_BLOCKS: tl.constexpr, MERGE: tl.constexpr,
                             GROUPS_PER_TILE: tl.constexpr, GROUP_COLUMNS: tl.constexpr, GROUP_BLOCK: tl.constexpr,
                             GROUPS_PER_STEP: tl.constexpr, RANK_ROWS: tl.constexpr, RANK_COLUMNS: tl.constexpr,
                             RANK_IN_KERNEL: tl.constexpr, GATHER_IN_KERNEL: tl.constexpr,
                             STAGES: tl.constexpr = 4):
    # STAGES < 4 stops early (benchmarks/teacher_epilogue_parts.py times the stages): 1 the lse,
    # 2 the threshold, 3 the listed groups, 4 everything
    row = tl.program_id(0).to(tl.int64)
    tile_max2 = row_logsumexp(tile_max2_ptr, tile_sum2_ptr, lse_ptr, row, tiles, TILES)
    if STAGES < 2:
        return
    groups = tiles * GROUPS_PER_TILE
    group_row = group_max_ptr + row * groups
    threshold = group_threshold(tile_max2, group_row, groups, tiles, k, log2e_over_t, TILES, THRESHOLD_BLOCKS, MERGE,
                                GROUPS_PER_TILE)
    if STAGES < 3:
        tl.store(counts_ptr + row, threshold)
        return
    listed = list_reaching_groups(group_row, groups, threshold, log2e_over_t, group_ids_ptr + row * capacity,
                                  capacity, GROUP_BLOCK)
    tl.debug_barrier()  # every thread's group ids are in memory

    if STAGES < 4:
        tl.store(counts_ptr + row, listed)
        return
    if not GATHER_IN_KERNEL:  # the extension gathers and orders them (csrc/candidates_from_groups.cu)
        tl.store(thresholds_ptr + row, threshold)
        tl.store(counts_ptr + row, listed)
        tl.store(overflow_ptr + row, (listed > capacity).to(tl.int8))
        return
    # their elements that reach it, as (value, complemented column) keys
    usable = tl.minimum(listed, capacity)
    lanes = tl.arange(0, GROUPS_PER_STEP * GROUP_COLUMNS)
    count = tl.zeros([], tl.int32)
    for start in range(0, usable, GROUPS_PER_STEP):
        in_list, columns = listed_columns(group_ids_ptr + row * capacity, start, usable, lanes, GROUP_COLUMNS)
        exists = in_list & (columns < width)
        z = tl.load(logits_ptr + row * stride_row + columns, mask=exists, other=float("-inf"))
        take = exists & (ordered_bits(z * log2e_over_t) >= threshold)
        count = append_keys(keys_ptr + row * capacity, count, capacity, take, z, columns)
    finish_row(row, count, (listed > capacity) | (count > capacity), keys_ptr, counts_ptr, overflow_ptr, values_ptr,
               columns_ptr, k, capacity, RANK_IN_KERNEL, RANK_ROWS, RANK_COLUMNS)


def selection_launch(summaries, k: int, merge: int | None = None) -> dict:
    """The selection kernel's shape constants and warps for these summaries and k (``merge``
    groups per threshold block; None: `threshold_merge`)."""
    tiles = summaries.tile_max2.shape[1]
    groups = summaries.group_max.shape[1]
    merge = merge or threshold_merge(k, groups, groups // tiles)
    large_k = merge != groups // tiles
    return dict(TILES=triton.next_power_of_2(tiles), THRESHOLD_BLOCKS=triton.next_power_of_2(-(-groups // merge)),
                MERGE=merge, GROUPS_PER_TILE=groups // tiles, GROUP_COLUMNS=summaries.group_columns,
                GROUP_BLOCK=GROUP_BLOCK[large_k], GROUPS_PER_STEP=GROUPS_PER_STEP[large_k],
                RANK_ROWS=RANK_TILE[large_k][0], RANK_COLUMNS=RANK_TILE[large_k][1],
                num_warps=SELECT_WARPS_LARGE_K if large_k else SELECT_WARPS)


def topk_from_group_maxima(logits: torch.Tensor, summaries, k: int, temperature: float, width: int,
                           order: str = "torch"):
    """logits ``[R, ≥ width]`` float32 and their `RowSummaries` -> (values ``[R, k]`` float32 =
    top logits / τ, descending, lower column first among ties, -inf past ``width``; columns
    ``[R, k]`` int32, 0 there; lse ``[R]`` float32 at τ; overflow ``[R]`` bool: rows to redo
    exactly, whose other outputs are meaningless). Past ``RANK_MAX_K`` the candidates are put
    in order by ``order``: "cuda" (the extension's sort per row) or "torch" (torch.sort)."""
    if order not in ("cuda", "torch"):
        raise ValueError(f"order: expected 'cuda' or 'torch', got {order!r}")
    rows = logits.shape[0]
    device = logits.device
    stages = SELECT_STAGES
    tiles = summaries.tile_max2.shape[1]
    capacity = capacity_for(k)
    rank_in_kernel = k <= RANK_MAX_K
    gather_in_cuda = GATHER_IN_CUDA and order == "cuda" and not rank_in_kernel
    log2e_over_t = LOG2E / temperature
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    columns = torch.empty(rows, k, dtype=torch.int32, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    overflow = torch.empty(rows, dtype=torch.int8, device=device)
    counts = torch.empty(rows, dtype=torch.int32, device=device)
    # the gather's keys where this kernel gathers; the threshold where the extension does
    keys = counts if gather_in_cuda else torch.empty(rows, capacity, dtype=torch.int64, device=device)
    thresholds = torch.empty(rows, dtype=torch.int32, device=device) if gather_in_cuda else counts
    group_ids = torch.empty(rows, capacity, dtype=torch.int32, device=device)
    if rows:
        _topk_from_groups_kernel[(rows,)](
            logits, logits.stride(0), summaries.tile_max2, summaries.tile_sum2, summaries.group_max, group_ids,
            thresholds, keys, counts, values, columns, lse, overflow, tiles, width, k, capacity,
            log2e_over_t, RANK_IN_KERNEL=rank_in_kernel, GATHER_IN_KERNEL=not gather_in_cuda, STAGES=stages,
            **selection_launch(summaries, k))
    if gather_in_cuda and stages == 4:
        from .topk_candidates import load_extension

        values, columns, overflowed = load_extension().candidates_from_groups(
            logits, group_ids, counts, thresholds, width, log2e_over_t, k, capacity)
        overflow |= overflowed.to(torch.int8)
    elif not rank_in_kernel and stages == 4:
        values, columns = top_of_counted_keys(keys, counts, k, order)
    return values.div_(temperature), columns, lse, overflow.bool()

