"""Each row's top-k from the matmul's group top-2 (ops/lm_head_group_maxima.py with
``group_top2``: each group's maximum, its column and the group's second largest), with no
logits stored and only the few groups holding two or more top-k elements computed again.

Let T be the k-th largest group maximum of a row (in the epilogue's units z · log2e / τ:
rounding is monotone), or any bound below it (`KTH_STEPS`). k distinct groups hold an element
≥ T, so the row's k-th value is ≥ T, and an element ≥ T lies in a group whose maximum reaches
T. The groups are a thread's registers in the matmul, interleaved (`top2_group_columns`). Of
those reaching T, one whose second largest is below T holds exactly one candidate, its
maximum, whose value and column the matmul left: a key without reading anything else. A group
whose second largest reaches T too (on LLM logits at k = 64 and V = 151,936 about 0.4 a row:
~C(k, 2) / groups) is computed again from the row's hidden state and the group's weight rows,
and its elements ≥ T (less a margin: those sums round apart from the matmul's by ulps) join the
keys.

Three launches per chunk of rows, no host work between them:
- one program per row: the logsumexp from the tile statistics; the groups reaching the tile
  threshold (ops/topk_from_groups.py; ~k of them); T by bisection over their maxima; the
  single-candidate keys; the ids of the groups to compute again (at most `most_groups_again`);
- one program per (row, slot of a group to compute again), most exiting at once: that group's
  logits, a 16-row tensor-core dot whose weight loads are pipelined (a plan grouping the pairs
  by group cost ~15 small launches a chunk: NOTES e25);
- one program per row: the recomputed elements ≥ T appended to the keys, the keys ranked.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .lm_head_group_maxima import top2_group_columns
from .sort_keys import ordered_bits, top_of_counted_keys
from .topk_from_groups import (LOG2E, RANK_MAX_K, RANK_TILE, append_keys, capacity_for, finish_row,
                               group_threshold, kth_largest_bits, list_reaching_groups, listed_columns,
                               row_logsumexp, selection_launch)
from .utils import kth_largest_lower_bound

SELECT_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 4
# hidden columns a recompute step reads: 256 over 128, H200 k = 64, 8192 rows: 0.29 against 0.36 ms
# (fewer dependent steps; 211 registers, but only a few hundred programs a chunk do work)
HIDDEN_STEP = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 256
GROUPS_PER_STEP = 4  # recomputed groups appended per step of the ranking kernel
# the listing's threshold: 0, the k-th largest tile maximum (a 32-step bisection on its bits);
# n > 0, a lower bound of it from n bisection steps in value space (a lower threshold lists a
# few more groups; T comes from the listed maxima). H200, 8192 rows: the candidates
# kernel 0.47 -> 0.33 ms at 8 steps, output bit-identical (results/maxima_selection_ab_607e5de.log)
LISTING_STEPS = 8
# T: 0, the k-th largest listed group maximum (a 32-step bisection on its bits); n > 0, a lower
# bound of it from n value-space bisection steps between the listed maxima's extremes (any T at
# or below the k-th largest group maximum keeps every top-k element among the keys: a lower one
# gives a few more single keys and groups to compute again, fewer dependent steps)
KTH_STEPS = 8
# below T, the recomputed elements still taken: relative to |T| + 1 (log2 units); their sums
# round apart from the matmul's by a few ulps, and a key too many is ranked away
RECOMPUTED_MARGIN = 2.0 ** -12


def most_groups_again(k: int) -> int:
    """Groups a row may compute again (rows with more are redone): the mean is ~k² / (2 ·
    groups) on LLM logits (0.4 at k = 64, 7 at k = 256 over 4748 groups; at most 4 and 15 of
    8192 rows, H200 runs), the tail Poisson-like."""
    return max(8, k // 8)


@triton.jit
def _kth_largest_below(values, valid, k, STEPS: tl.constexpr):
    """The ordered bits of a lower bound of the k-th largest valid value (1-D float32) from STEPS
    bisection steps (`kth_largest_lower_bound`); the smallest int32 where fewer than k are valid."""
    low = kth_largest_lower_bound(values, valid, k, STEPS)
    few = tl.sum(valid.to(tl.int32), axis=0) < k
    return tl.where(few | (low == float("-inf")), -2147483648, ordered_bits(low))


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
    if LISTING_STEPS > 0 and MERGE == GROUPS_PER_TILE:
        threshold = _kth_largest_below(tile_max2, tl.arange(0, TILES) < tiles, k, LISTING_STEPS)
    else:
        threshold = group_threshold(tile_max2, group_max_ptr + group_row, groups, tiles, k, log2e_over_t, TILES,
                                    THRESHOLD_BLOCKS, MERGE, GROUPS_PER_TILE)
    row_ids = group_ids_ptr + row * capacity
    listed = list_reaching_groups(group_max_ptr + group_row, groups, threshold, log2e_over_t, row_ids, capacity,
                                  GROUP_BLOCK)
    tl.debug_barrier()  # every thread's group ids are in memory
    slot = tl.arange(0, SLOTS)
    in_list = slot < tl.minimum(listed, capacity)
    group = tl.load(row_ids + slot, mask=in_list, other=0)
    maximum = tl.load(group_max_ptr + group_row + group, mask=in_list, other=float("-inf"))
    maximum2 = maximum * log2e_over_t
    maximum_bits = ordered_bits(maximum2)
    # T: the k-th largest group maximum or a bound below it (every group reaching the k-th
    # largest is listed: the tile threshold is lower)
    if KTH_STEPS > 0:
        kth = _kth_largest_below(maximum2, in_list, k, KTH_STEPS)
    else:
        kth = kth_largest_bits(maximum_bits, in_list, k)
    second = tl.load(group_second_ptr + group_row + group, mask=in_list, other=float("-inf"))
    reaching = in_list & (maximum_bits >= kth)
    again = reaching & (ordered_bits(second * log2e_over_t) >= kth)
    single = reaching & ~again
    column = top2_group_columns(group, tl.load(group_arg_ptr + group_row + group, mask=single, other=0).to(tl.int32),
                                GROUP_COLUMNS)
    count = append_keys(keys_ptr + row * capacity, tl.zeros([], tl.int32), capacity, single, maximum, column)
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
                                   RANK_COLUMNS: tl.constexpr, RANK_IN_KERNEL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    usable = tl.minimum(tl.load(again_count_ptr + row), most_again)
    kth = tl.load(thresholds_ptr + row)
    kth_value = tl.where(kth < 0, kth ^ 0x7FFFFFFF, kth).to(tl.float32, bitcast=True)
    floor = tl.where(kth == -2147483648, float("-inf"), kth_value - (tl.abs(kth_value) + 1.0) * margin)
    lanes = tl.arange(0, GROUPS_PER_STEP * GROUP_COLUMNS)
    for start in range(0, usable, GROUPS_PER_STEP):
        in_list, columns = listed_columns(again_ptr + row * most_again, start, usable, lanes, GROUP_COLUMNS, True)
        z = tl.load(again_logits_ptr + (row * most_again + start) * GROUP_COLUMNS + lanes, mask=in_list,
                    other=float("-inf"))
        take = in_list & (columns < width) & (z * log2e_over_t >= floor)
        count = append_keys(keys_ptr + row * capacity, count, capacity, take, z, columns)
    overflowed = (tl.load(overflow_ptr + row) != 0) | (count > capacity)
    finish_row(row, count, overflowed, keys_ptr, counts_ptr, overflow_ptr, values_ptr, columns_ptr, k, capacity,
               RANK_IN_KERNEL, RANK_ROWS, RANK_COLUMNS)


def topk_from_group_top2(hidden: torch.Tensor, weight: torch.Tensor, bias, summaries, k: int, temperature: float,
                         width: int, outputs=None, order: str = "torch"):
    """hidden ``[R, H]``, weight ``[≥ width, H]``, bias ``[≥ width]`` or None (what the matmul
    took) and its `RowSummaries` with group top-2 -> (values ``[R, k]`` float32 logits before τ,
    descending, lower column first among ties, -inf past the candidates; columns ``[R, k]``
    int32, 0 there; lse ``[R]`` float32 at τ; overflow ``[R]`` bool: more listed groups,
    candidates or groups to compute again than there is room for, redo the row), written into
    ``outputs`` (that tuple, each contiguous) where given. Past ``RANK_MAX_K`` the keys are
    ordered by ``order`` ("cuda": the extension's sort per row, or "torch")."""
    if summaries.group_arg is None or summaries.group_second is None:
        raise ValueError("summaries: expected the group top-2 (EpilogueMatmul(..., group_top2=True)), got maxima only")
    if hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"hidden, weight: expected contiguous rows, got strides {tuple(hidden.stride())}, "
                         f"{tuple(weight.stride())}")
    rows, tiles = summaries.tile_max2.shape
    device = summaries.group_max.device
    capacity, most_again, group_columns = capacity_for(k), most_groups_again(k), summaries.group_columns
    log2e_over_t = LOG2E / temperature
    rank_in_kernel = k <= RANK_MAX_K
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
    launch = selection_launch(summaries, k)
    launch = {name: launch[name] for name in ("TILES", "THRESHOLD_BLOCKS", "MERGE", "GROUPS_PER_TILE",
                                               "GROUP_COLUMNS", "GROUP_BLOCK")}
    _group_top2_candidates_kernel[(rows,)](
        summaries.tile_max2, summaries.tile_sum2, summaries.group_max, summaries.group_arg, summaries.group_second,
        group_ids, again, again_count, keys, counts, thresholds, lse, overflow.view(torch.int8), tiles, k, capacity,
        most_again, log2e_over_t, SLOTS=triton.next_power_of_2(capacity), LISTING_STEPS=LISTING_STEPS,
        KTH_STEPS=KTH_STEPS,
        num_warps=SELECT_WARPS, **launch)
    _again_group_logits_kernel[(rows, most_again)](
        hidden, weight, bias if bias is not None else again_logits, again, again_count, again_logits, width,
        hidden.shape[1], hidden.stride(0), weight.stride(0), most_again, HAS_BIAS=bias is not None,
        GROUP_COLUMNS=group_columns, HIDDEN_STEP=HIDDEN_STEP,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        num_warps=1 if os.environ.get("TRITON_INTERPRET") == "1" else 4, num_stages=3)
    _topk_of_keys_and_again_kernel[(rows,)](
        keys, counts, again_logits, again, again_count, thresholds, values, columns, overflow.view(torch.int8), width,
        k, capacity, most_again, log2e_over_t, RECOMPUTED_MARGIN, GROUP_COLUMNS=group_columns,
        GROUPS_PER_STEP=GROUPS_PER_STEP, RANK_ROWS=RANK_TILE[0][0], RANK_COLUMNS=RANK_TILE[0][1],
        RANK_IN_KERNEL=rank_in_kernel, num_warps=SELECT_WARPS)
    if not rank_in_kernel:
        values[:], columns[:] = top_of_counted_keys(keys, counts, k, order)
    return values, columns, lse, overflow
