"""Each row's top-k from the matmul's group top-2 (ops/lm_head_group_maxima.py with
``group_top2``: each group's maximum, its column and the group's second largest), with no
logits stored and only the few groups holding two or more top-k elements computed again.

Let T be the k-th largest group maximum of a row (in the epilogue's units z · log2e / τ:
rounding is monotone), or any bound below it (`KTH_STEPS`). k distinct groups hold an element
≥ T, so the row's k-th value is ≥ T, and an element ≥ T lies in a group whose maximum reaches
T. The groups are a thread's registers in the matmul, interleaved (`top2_group_columns`). Of
those reaching T, one whose second largest is below T holds exactly one candidate, its
maximum, whose value and column the matmul left: a key without reading anything else. A group
whose second largest reaches T too (about C(k, 2) / groups a row on LLM logits) is computed
again from the row's hidden state and the group's weight rows, and its elements ≥ T (less a
margin: those sums round apart from the matmul's by ulps) join the keys.

Three launches per chunk of rows, no host work between them:
- one program per row: the logsumexp from the tile statistics; the groups reaching a lower
  bound of the k-th largest tile maximum (or of blocks of adjacent groups where there are
  fewer than 2k tiles; ~k groups); T over their maxima; the single-candidate keys; the ids of
  the groups to compute again (at most `most_groups_again`);
- one program per (row, slot of a group to compute again), most exiting at once: that group's
  logits, a 16-row tensor-core dot whose weight loads are pipelined;
- one program per row: the recomputed elements ≥ T appended to the keys, and the keys ranked
  in place: each stored at its rank, the count of larger keys (O(count²) compares, cheap at
  ~k keys, no sort network).

Rows with more listed groups, keys or groups to compute again than there are slots for
(massive ties) are flagged for the caller's exact redo.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED
from .lm_head_group_maxima import top2_group_columns
from .sort_keys import ordered_bits, value_column_key, value_of_key
from .utils import LOG2E, kth_largest_lower_bound, row_logsumexp

ROW_WARPS = 1 if INTERPRETED else 4
# hidden columns a recompute step reads: fewer dependent steps (only a few hundred programs a
# chunk do work, so their registers do not bound anything)
HIDDEN_STEP = 16 if INTERPRETED else 256
GROUPS_PER_STEP = 4  # recomputed groups appended per step of the ranking kernel
# group maxima per step of the listing: where the threshold comes from blocks of adjacent
# groups (fewer than 2k tiles), wider steps
GROUP_BLOCK = (512, 2048)
# keys ranked at once × keys compared against at a time (a small tile: registers bound the
# occupancy)
RANK_ROWS, RANK_COLUMNS = (16, 64) if INTERPRETED else (8, 64)
# value-space bisection steps of the listing's threshold (a lower bound of the k-th largest
# tile maximum) and of T (a lower bound of the k-th largest listed group maximum): any lower
# bound keeps every top-k element among the keys; a lower one lists a few more groups and
# gives a few more single keys and groups to compute again, for fewer dependent steps
LISTING_STEPS = 8
KTH_STEPS = 8
# below T, the recomputed elements still taken: relative to |T| + 1 (log2 units); their sums
# round apart from the matmul's by a few ulps, and a key too many is ranked away
RECOMPUTED_MARGIN = 2.0 ** -12


def capacity_for(k: int) -> int:
    """Key slots (and listed-group slots) a row: several times the ~k a row needs on LLM logits
    (ranking costs the square of the count, not of the slots; rows past it are redone)."""
    return max(256, 4 * k)


def most_groups_again(k: int) -> int:
    """Groups a row may compute again (rows with more are redone): the mean is ~k² / (2 ·
    groups) on LLM logits, the tail Poisson-like."""
    return max(8, k // 8)


def threshold_merge(k: int, groups: int, groups_per_tile: int) -> int:
    """Adjacent groups per block of the listing's threshold: as many as leave at least 2k
    blocks (a whole tile: the tile maxima, already loaded for the lse; one group: however few
    there are)."""
    merge = groups_per_tile
    while merge > 1 and groups // merge < 2 * k:
        merge //= 2
    return merge


@triton.jit
def _kth_largest_bits(block_key, valid, k):
    """The largest t (int32 ordered bits) with at least k valid keys ≥ t in ``block_key`` (any
    shape); the smallest int32 where fewer than k are valid."""
    low = tl.full([], -2147483648, tl.int64)
    high = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        middle = low + (high - low + 1) // 2
        reaching = tl.sum(((block_key >= middle.to(tl.int32)) & valid).to(tl.int32))
        enough = reaching >= k
        low = tl.where(enough, middle, low)
        high = tl.where(enough, high, middle - 1)
    return low.to(tl.int32)


@triton.jit
def _kth_largest_below(values, valid, k, STEPS: tl.constexpr):
    """The ordered bits of a lower bound of the k-th largest valid value (1-D float32) from STEPS
    bisection steps (`kth_largest_lower_bound`); the smallest int32 where fewer than k are valid."""
    low = kth_largest_lower_bound(values, valid, k, STEPS)
    few = tl.sum(valid.to(tl.int32), axis=0) < k
    return tl.where(few | (low == float("-inf")), -2147483648, ordered_bits(low))


@triton.jit
def _merged_groups_threshold(group_row, groups, k, log2e_over_t, THRESHOLD_BLOCKS: tl.constexpr,
                             MERGE: tl.constexpr):
    """The ordered bits of the k-th largest maximum of blocks of MERGE adjacent groups, in the
    epilogue's units z · log2e / τ (≥ 2k such blocks, ~k candidate groups); the smallest int32
    where fewer than k blocks exist."""
    block = tl.arange(0, THRESHOLD_BLOCKS)[:, None] * MERGE + tl.arange(0, MERGE)[None, :]
    block_max = tl.max(tl.load(group_row + block, mask=block < groups, other=float("-inf")), axis=1)
    return _kth_largest_bits(ordered_bits(block_max * log2e_over_t), tl.arange(0, THRESHOLD_BLOCKS) * MERGE < groups,
                             k)


@triton.jit
def _list_reaching_groups(group_row, groups, threshold, log2e_over_t, row_group_ids_ptr, capacity,
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
def _append_keys(row_keys_ptr, count, capacity, take, values, columns):
    """The taken (value, column) keys stored at a row's next slots, in lane order (those past
    ``capacity`` dropped: the caller flags the row); returns the new count, which may pass it."""
    position = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(row_keys_ptr + position, value_column_key(values, columns), mask=take & (position < capacity))
    return count + tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _store_in_rank_order(keys_ptr, count, values_ptr, columns_ptr, k, RANK_ROWS: tl.constexpr,
                         RANK_COLUMNS: tl.constexpr):
    """The first k of ``count`` distinct keys in descending order, each at its rank (the number
    of larger keys), RANK_ROWS keys against RANK_COLUMNS others at a time; positions past
    ``count`` get -inf at column 0."""
    fill = tl.arange(0, RANK_COLUMNS)
    for start in range(0, k, RANK_COLUMNS):
        position = start + fill
        missing = (position >= count) & (position < k)
        tl.store(values_ptr + position, tl.full([RANK_COLUMNS], float("-inf"), tl.float32), mask=missing)
        tl.store(columns_ptr + position, tl.zeros([RANK_COLUMNS], tl.int32), mask=missing)
    for start in range(0, count, RANK_ROWS):
        mine = start + tl.arange(0, RANK_ROWS)
        key = tl.load(keys_ptr + mine, mask=mine < count, other=0)
        # counted per lane, summed once (a reduction across threads per step costs barriers)
        larger = tl.zeros([RANK_ROWS, RANK_COLUMNS], tl.int32)
        for other_start in range(0, count, RANK_COLUMNS):
            other = other_start + fill
            other_key = tl.load(keys_ptr + other, mask=other < count, other=-9_223_372_036_854_775_807 - 1)
            larger += (other_key[None, :] > key[:, None]).to(tl.int32)
        rank = tl.sum(larger, axis=1)
        kept = (mine < count) & (rank < k)
        tl.store(values_ptr + rank, value_of_key(key), mask=kept)
        tl.store(columns_ptr + rank, (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32), mask=kept)


@triton.jit
def _group_top2_candidates_kernel(tile_max2_ptr, tile_sum2_ptr, group_max_ptr, group_arg_ptr, group_second_ptr,
                                  group_ids_ptr, again_ptr, again_count_ptr, keys_ptr, counts_ptr, thresholds_ptr,
                                  lse_ptr, overflow_ptr, tiles, k, capacity, most_again, log2e_over_t,
                                  TILES: tl.constexpr, THRESHOLD_BLOCKS: tl.constexpr, MERGE: tl.constexpr,
                                  GROUPS_PER_TILE: tl.constexpr, GROUP_COLUMNS: tl.constexpr,
                                  GROUP_BLOCK: tl.constexpr, SLOTS: tl.constexpr, LISTING_STEPS: tl.constexpr,
                                  KTH_STEPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile_max2 = row_logsumexp(tile_max2_ptr, tile_sum2_ptr, lse_ptr, row, tiles, TILES)
    groups = tiles * GROUPS_PER_TILE
    group_row = row * groups
    if MERGE == GROUPS_PER_TILE:  # a lower bound of the k-th largest tile maximum
        threshold = _kth_largest_below(tile_max2, tl.arange(0, TILES) < tiles, k, LISTING_STEPS)
    else:
        threshold = _merged_groups_threshold(group_max_ptr + group_row, groups, k, log2e_over_t, THRESHOLD_BLOCKS,
                                             MERGE)
    row_ids = group_ids_ptr + row * capacity
    listed = _list_reaching_groups(group_max_ptr + group_row, groups, threshold, log2e_over_t, row_ids, capacity,
                                   GROUP_BLOCK)
    tl.debug_barrier()  # every thread's group ids are in memory
    slot = tl.arange(0, SLOTS)
    in_list = slot < tl.minimum(listed, capacity)
    group = tl.load(row_ids + slot, mask=in_list, other=0)
    maximum = tl.load(group_max_ptr + group_row + group, mask=in_list, other=float("-inf"))
    maximum2 = maximum * log2e_over_t
    maximum_bits = ordered_bits(maximum2)
    # T: a bound below the k-th largest group maximum (every group reaching the k-th largest is
    # listed: the listing's threshold is lower)
    kth = _kth_largest_below(maximum2, in_list, k, KTH_STEPS)
    second = tl.load(group_second_ptr + group_row + group, mask=in_list, other=float("-inf"))
    reaching = in_list & (maximum_bits >= kth)
    again = reaching & (ordered_bits(second * log2e_over_t) >= kth)
    single = reaching & ~again
    column = top2_group_columns(group, tl.load(group_arg_ptr + group_row + group, mask=single, other=0).to(tl.int32),
                                GROUP_COLUMNS)
    count = _append_keys(keys_ptr + row * capacity, tl.zeros([], tl.int32), capacity, single, maximum, column)
    place = tl.cumsum(again.to(tl.int32), axis=0) - 1
    tl.store(again_ptr + row * most_again + place, group, mask=again & (place < most_again))
    again_count = tl.sum(again.to(tl.int32), axis=0)
    tl.store(again_count_ptr + row, again_count)
    tl.store(counts_ptr + row, count)
    tl.store(thresholds_ptr + row, kth)
    tl.store(overflow_ptr + row, ((listed > capacity) | (count > capacity) | (again_count > most_again)).to(tl.int8))


@triton.jit
def _again_group_logits_kernel(hidden_ptr, weight_ptr, bias_ptr, again_ptr, again_count_ptr, out_ptr, width,
                               hidden_size, stride_hidden, stride_weight, most_again, HAS_BIAS: tl.constexpr,
                               GROUP_COLUMNS: tl.constexpr, HIDDEN_STEP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # one program per (row, slot): the row's slot-th group to compute again, if it has one; the
    # hidden row fills the first of 16 dot rows (the smallest tile the matrix units take), so
    # the weight loads feeding the dot are pipelined
    row = tl.program_id(0).to(tl.int64)
    entry = tl.program_id(1)
    if entry >= tl.minimum(tl.load(again_count_ptr + row), most_again):
        return
    group = tl.load(again_ptr + row * most_again + entry)
    columns = top2_group_columns(group, tl.arange(0, GROUP_COLUMNS), GROUP_COLUMNS)
    exists = columns < width
    first = tl.arange(0, 16) == 0
    accumulator = tl.zeros([16, GROUP_COLUMNS], tl.float32)
    for start in range(0, hidden_size, HIDDEN_STEP):
        depth = start + tl.arange(0, HIDDEN_STEP)
        inside = depth < hidden_size
        h = tl.load(hidden_ptr + row * stride_hidden + depth[None, :] + tl.zeros([16, 1], tl.int64),
                    mask=first[:, None] & inside[None, :], other=0.0)
        w = tl.load(weight_ptr + columns.to(tl.int64)[:, None] * stride_weight + depth[None, :],
                    mask=exists[:, None] & inside[None, :], other=0.0)
        accumulator = tl.dot(h, tl.trans(w), accumulator, input_precision=DOT_PRECISION)
    logits = tl.sum(tl.where(first[:, None], accumulator, 0.0), axis=0)
    if HAS_BIAS:
        logits += tl.load(bias_ptr + columns, mask=exists, other=0.0).to(tl.float32)
    tl.store(out_ptr + (row * most_again + entry) * GROUP_COLUMNS + tl.arange(0, GROUP_COLUMNS),
             tl.where(exists, logits, float("-inf")))


@triton.jit
def _topk_of_keys_and_again_kernel(keys_ptr, counts_ptr, again_logits_ptr, again_ptr, again_count_ptr,
                                   thresholds_ptr, values_ptr, columns_ptr, overflow_ptr, width, k, capacity,
                                   most_again, log2e_over_t, margin, GROUP_COLUMNS: tl.constexpr,
                                   GROUPS_PER_STEP: tl.constexpr, RANK_ROWS: tl.constexpr,
                                   RANK_COLUMNS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    usable = tl.minimum(tl.load(again_count_ptr + row), most_again)
    kth = tl.load(thresholds_ptr + row)
    kth_value = tl.where(kth < 0, kth ^ 0x7FFFFFFF, kth).to(tl.float32, bitcast=True)
    floor = tl.where(kth == -2147483648, float("-inf"), kth_value - (tl.abs(kth_value) + 1.0) * margin)
    lanes = tl.arange(0, GROUPS_PER_STEP * GROUP_COLUMNS)
    for start in range(0, usable, GROUPS_PER_STEP):
        # the lanes' groups among those to compute again, and their columns
        entry = start + lanes // GROUP_COLUMNS
        in_list = entry < usable
        group = tl.load(again_ptr + row * most_again + entry, mask=in_list, other=0)
        columns = top2_group_columns(group, lanes % GROUP_COLUMNS, GROUP_COLUMNS)
        z = tl.load(again_logits_ptr + (row * most_again + start) * GROUP_COLUMNS + lanes, mask=in_list,
                    other=float("-inf"))
        take = in_list & (columns < width) & (z * log2e_over_t >= floor)
        count = _append_keys(keys_ptr + row * capacity, count, capacity, take, z, columns)
    overflowed = (tl.load(overflow_ptr + row) != 0) | (count > capacity)
    tl.store(overflow_ptr + row, overflowed.to(tl.int8))
    count = tl.minimum(count, capacity)
    tl.store(counts_ptr + row, count)
    tl.debug_barrier()  # every thread's keys are in memory
    _store_in_rank_order(keys_ptr + row * capacity, count, values_ptr + row * k, columns_ptr + row * k, k, RANK_ROWS,
                         RANK_COLUMNS)


def topk_from_group_top2(hidden: torch.Tensor, weight: torch.Tensor, bias, summaries, k: int, temperature: float,
                         width: int, outputs=None):
    """hidden ``[R, H]``, weight ``[≥ width, H]``, bias ``[≥ width]`` or None (what the matmul
    took) and its `RowSummaries` with group top-2 -> (values ``[R, k]`` float32 logits before τ,
    descending, lower column first among ties, -inf past the candidates; columns ``[R, k]``
    int32, 0 there; lse ``[R]`` float32 at τ; overflow ``[R]`` bool: more listed groups,
    candidates or groups to compute again than there is room for, redo the row), written into
    ``outputs`` (that tuple, each contiguous) where given. The ranking counts compares (the
    square of a row's keys): meant for small k (the maxima schedule's)."""
    if summaries.group_arg is None or summaries.group_second is None:
        raise ValueError("summaries: expected the group top-2 (EpilogueMatmul(..., group_top2=True)), got maxima only")
    if hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"hidden, weight: expected contiguous rows, got strides {tuple(hidden.stride())}, "
                         f"{tuple(weight.stride())}")
    rows, tiles = summaries.tile_max2.shape
    groups = summaries.group_max.shape[1]
    device = summaries.group_max.device
    capacity, most_again, group_columns = capacity_for(k), most_groups_again(k), summaries.group_columns
    log2e_over_t = LOG2E / temperature
    if outputs is None:
        outputs = (torch.empty(rows, k, dtype=torch.float32, device=device),
                   torch.empty(rows, k, dtype=torch.int32, device=device),
                   torch.empty(rows, dtype=torch.float32, device=device),
                   torch.empty(rows, dtype=torch.bool, device=device))
    values, columns, lse, overflow = outputs
    if not rows:
        return values, columns, lse, overflow
    keys = torch.empty(rows, capacity, dtype=torch.int64, device=device)
    counts = torch.empty(rows, dtype=torch.int32, device=device)
    group_ids = torch.empty(rows, capacity, dtype=torch.int32, device=device)
    again = torch.empty(rows, most_again, dtype=torch.int32, device=device)
    again_count = torch.empty(rows, dtype=torch.int32, device=device)
    thresholds = torch.empty(rows, dtype=torch.int32, device=device)
    again_logits = torch.empty(rows, most_again, group_columns, dtype=torch.float32, device=device)
    groups_per_tile = groups // tiles
    merge = threshold_merge(k, groups, groups_per_tile)
    _group_top2_candidates_kernel[(rows,)](
        summaries.tile_max2, summaries.tile_sum2, summaries.group_max, summaries.group_arg, summaries.group_second,
        group_ids, again, again_count, keys, counts, thresholds, lse, overflow.view(torch.int8), tiles, k, capacity,
        most_again, log2e_over_t, TILES=triton.next_power_of_2(tiles),
        THRESHOLD_BLOCKS=triton.next_power_of_2(-(-groups // merge)), MERGE=merge, GROUPS_PER_TILE=groups_per_tile,
        GROUP_COLUMNS=group_columns, GROUP_BLOCK=GROUP_BLOCK[merge != groups_per_tile],
        SLOTS=triton.next_power_of_2(capacity), LISTING_STEPS=LISTING_STEPS, KTH_STEPS=KTH_STEPS,
        num_warps=ROW_WARPS)
    _again_group_logits_kernel[(rows, most_again)](
        hidden, weight, bias if bias is not None else again_logits, again, again_count, again_logits, width,
        hidden.shape[1], hidden.stride(0), weight.stride(0), most_again, HAS_BIAS=bias is not None,
        GROUP_COLUMNS=group_columns, HIDDEN_STEP=HIDDEN_STEP,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", num_warps=ROW_WARPS, num_stages=3)
    _topk_of_keys_and_again_kernel[(rows,)](
        keys, counts, again_logits, again, again_count, thresholds, values, columns, overflow.view(torch.int8), width,
        k, capacity, most_again, log2e_over_t, RECOMPUTED_MARGIN, GROUP_COLUMNS=group_columns,
        GROUPS_PER_STEP=GROUPS_PER_STEP, RANK_ROWS=RANK_ROWS, RANK_COLUMNS=RANK_COLUMNS, num_warps=ROW_WARPS)
    return values, columns, lse, overflow
