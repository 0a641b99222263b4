"""Each row's top-k from the matmul's group top-2 (ops/lm_head_group_maxima.py with
``group_top2``: each group's maximum, its column and the group's second largest), with no
logits stored and only the few groups holding two or more top-k elements computed again.

Let T be the k-th largest group maximum of a row (in the epilogue's units z · log2e / τ:
rounding is monotone). k distinct groups hold an element ≥ T, so the row's k-th value is ≥ T,
and an element ≥ T lies in a group whose maximum reaches T. Of those groups, one whose second
largest is below T holds exactly one candidate, its maximum, whose value and column the
matmul left: a key without reading anything else. A group whose second largest reaches T (on
LLM logits at k = 64 and V = 151,936 about 0.4 a row: C(k, 2) / groups) is computed again
(ops/listed_group_logits.py) and its elements ≥ T join the keys.

Two kernels, one program per row:
- `group_top2_candidates`: the logsumexp from the tile statistics; T by bisection over the
  maxima of the groups reaching the tile threshold (ops/topk_from_groups.py; ~k of them); the
  single-candidate groups' keys; the ids of the groups to compute again, each with its place
  among the group's pairs (an atomic) for `plan_pairs`;
- `topk_of_keys_and_groups`: the recomputed groups' elements ≥ T (less a margin: the
  recomputed sums round apart from the matmul's by ulps) appended to the keys, then ranked.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .sort_keys import ordered_bits, top_of_counted_keys
from .topk_from_groups import (RANK_MAX_K, RANK_TILE, _LOG2E, _launch, append_keys, capacity_for, finish_row,
                               group_threshold, kth_largest_bits, list_reaching_groups, listed_columns, row_logsumexp)

SELECT_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 4
GROUPS_PER_STEP = 4  # recomputed groups appended per step (~0.4 a row at k = 64)
# below T, the recomputed elements still taken: relative to |T| + 1 (log2 units); their sums
# round apart from the matmul's by a few ulps, and a key too many is ranked away
RECOMPUTED_MARGIN = 2.0 ** -12


@triton.jit
def _group_top2_candidates_kernel(tile_max2_ptr, tile_sum2_ptr, group_max_ptr, group_arg_ptr, group_second_ptr,
                                  group_ids_ptr, group_counts_ptr, ranks_ptr, keys_ptr, counts_ptr, recompute_ptr,
                                  thresholds_ptr, lse_ptr, overflow_ptr, tiles, width, k, capacity, log2e_over_t,
                                  TILES: tl.constexpr, THRESHOLD_BLOCKS: tl.constexpr, MERGE: tl.constexpr,
                                  GROUPS_PER_TILE: tl.constexpr, GROUP_COLUMNS: tl.constexpr,
                                  GROUP_BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile_max2 = row_logsumexp(tile_max2_ptr, tile_sum2_ptr, lse_ptr, row, tiles, TILES)
    groups = tiles * GROUPS_PER_TILE
    group_row = row * groups
    threshold = group_threshold(tile_max2, group_max_ptr + group_row, groups, tiles, k, log2e_over_t, TILES,
                                THRESHOLD_BLOCKS, MERGE, GROUPS_PER_TILE)
    row_ids = group_ids_ptr + row * capacity
    listed = list_reaching_groups(group_max_ptr + group_row, groups, threshold, log2e_over_t, row_ids,
                                  group_counts_ptr, ranks_ptr, capacity, GROUP_BLOCK, False)
    tl.debug_barrier()  # every thread's group ids are in memory
    slot = tl.arange(0, SLOTS)
    in_list = slot < tl.minimum(listed, capacity)
    group = tl.load(row_ids + slot, mask=in_list, other=0)
    maximum = tl.load(group_max_ptr + group_row + group, mask=in_list, other=float("-inf"))
    maximum_bits = ordered_bits(maximum * log2e_over_t)
    # T: the k-th largest group maximum (every group reaching it is listed: the tile threshold is lower)
    kth = kth_largest_bits(maximum_bits, in_list, k)
    second = tl.load(group_second_ptr + group_row + group, mask=in_list, other=float("-inf"))
    reaching = in_list & (maximum_bits >= kth)
    again = reaching & (ordered_bits(second * log2e_over_t) >= kth)
    single = reaching & ~again
    column = group * GROUP_COLUMNS + tl.load(group_arg_ptr + group_row + group, mask=single, other=0).to(tl.int32)
    count = append_keys(keys_ptr + row * capacity, tl.zeros([], tl.int32), capacity, single, maximum, column)
    tl.debug_barrier()  # the listed ids are read: their slots now take the ids to compute again
    place = tl.cumsum(again.to(tl.int32), axis=0) - 1
    tl.store(row_ids + place, group, mask=again)
    rank = tl.atomic_add(group_counts_ptr + group, 1, mask=again, sem="relaxed")
    tl.store(ranks_ptr + row * capacity + place, rank, mask=again)
    tl.store(recompute_ptr + row, tl.sum(again.to(tl.int32), axis=0))
    tl.store(counts_ptr + row, count)
    tl.store(thresholds_ptr + row, kth)
    tl.store(overflow_ptr + row, (listed > capacity).to(tl.int8))


def group_top2_candidates(summaries, k: int, temperature: float, width: int):
    """The chunk's `RowSummaries` with group top-2 -> (lse ``[R]`` float32 at τ; keys
    ``[R, capacity_for(k)]`` int64, the first ``counts [R]`` int32 those of single-candidate
    groups (value before τ, column); group_ids ``[R, capacity]`` int32, the first
    ``recompute [R]`` int32 the groups to compute again, in column order; group_counts ``[G]``
    int32 and ranks ``[R, capacity]`` int32, each such pair's place among its group's (for
    `plan_pairs`); thresholds ``[R]`` int32, T's ordered bits in log2 units at τ (the smallest
    int32 where fewer than k groups exist); overflow ``[R]`` bool, more listed groups than the
    capacity: redo the row)."""
    if summaries.group_arg is None or summaries.group_second is None:
        raise ValueError("summaries: expected the group top-2 (EpilogueMatmul(..., group_top2=True)), got maxima only")
    rows, tiles = summaries.tile_max2.shape
    groups = summaries.group_max.shape[1]
    device = summaries.group_max.device
    capacity = capacity_for(k)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    keys = torch.empty(rows, capacity, dtype=torch.int64, device=device)
    counts = torch.empty(rows, dtype=torch.int32, device=device)
    group_ids = torch.empty(rows, capacity, dtype=torch.int32, device=device)
    recompute = torch.empty(rows, dtype=torch.int32, device=device)
    group_counts = torch.zeros(groups, dtype=torch.int32, device=device)
    ranks = torch.empty(rows, capacity, dtype=torch.int32, device=device)
    thresholds = torch.empty(rows, dtype=torch.int32, device=device)
    overflow = torch.empty(rows, dtype=torch.int8, device=device)
    if rows:
        launch = _launch(summaries, k)
        launch = {name: launch[name] for name in ("TILES", "THRESHOLD_BLOCKS", "MERGE", "GROUPS_PER_TILE",
                                                   "GROUP_COLUMNS", "GROUP_BLOCK")}
        _group_top2_candidates_kernel[(rows,)](
            summaries.tile_max2, summaries.tile_sum2, summaries.group_max, summaries.group_arg, summaries.group_second,
            group_ids, group_counts, ranks, keys, counts, recompute, thresholds, lse, overflow, tiles, width, k,
            capacity, _LOG2E / temperature, SLOTS=triton.next_power_of_2(capacity), num_warps=SELECT_WARPS, **launch)
    return lse, keys, counts, group_ids, recompute, group_counts, ranks, thresholds, overflow.bool()


@triton.jit
def _topk_of_keys_and_groups_kernel(keys_ptr, counts_ptr, group_logits_ptr, offsets_ptr, group_ids_ptr, recompute_ptr,
                                    thresholds_ptr, values_ptr, columns_ptr, overflow_ptr, width, k, capacity, budget,
                                    log2e_over_t, margin, GROUP_COLUMNS: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
                                    RANK_ROWS: tl.constexpr, RANK_COLUMNS: tl.constexpr,
                                    RANK_IN_KERNEL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    usable = tl.load(recompute_ptr + row)
    offset = tl.load(offsets_ptr + row)
    usable = tl.where(offset + usable > budget, 0, usable)  # not recomputed: the plan flagged the row
    kth = tl.load(thresholds_ptr + row)
    kth_value = tl.where(kth < 0, kth ^ 0x7FFFFFFF, kth).to(tl.float32, bitcast=True)
    floor = tl.where(kth == -2147483648, float("-inf"), kth_value - (tl.abs(kth_value) + 1.0) * margin)
    lanes = tl.arange(0, GROUPS_PER_STEP * GROUP_COLUMNS)
    for start in range(0, usable, GROUPS_PER_STEP):
        in_list, columns = listed_columns(group_ids_ptr + row * capacity, start, usable, lanes, GROUP_COLUMNS)
        z = tl.load(group_logits_ptr + (offset + start) * GROUP_COLUMNS + lanes, mask=in_list, other=float("-inf"))
        take = in_list & (columns < width) & (z * log2e_over_t >= floor)
        count = append_keys(keys_ptr + row * capacity, count, capacity, take, z, columns)
    finish_row(row, count, count > capacity, keys_ptr, counts_ptr, overflow_ptr, values_ptr, columns_ptr, k, capacity,
               RANK_IN_KERNEL, RANK_ROWS, RANK_COLUMNS)


def topk_of_keys_and_groups(keys: torch.Tensor, counts: torch.Tensor, group_logits: torch.Tensor,
                            offsets: torch.Tensor, group_ids: torch.Tensor, recompute: torch.Tensor,
                            thresholds: torch.Tensor, k: int, temperature: float, width: int, order: str = "torch"):
    """`group_top2_candidates`' keys, counts, group_ids, recompute and thresholds, with the
    recomputed groups' logits ``[P, GROUP_COLUMNS]`` float32 (row r's from ``offsets[r]``
    int64, `plan_pairs`) -> (values ``[R, k]`` float32 logits before τ, descending, lower
    column first among ties, -inf past the candidates; columns ``[R, k]`` int32, 0 there;
    overflow ``[R]`` bool: more candidates than the capacity, redo the row). ``keys`` and
    ``counts`` are appended to in place. Past ``RANK_MAX_K`` the keys are ordered by ``order``
    ("cuda" or "torch")."""
    rows, capacity = keys.shape
    if capacity != capacity_for(k) or group_ids.shape != keys.shape:
        raise ValueError(f"keys, group_ids: expected [{rows}, {capacity_for(k)}] for k = {k}, got "
                         f"{list(keys.shape)}, {list(group_ids.shape)}")
    device = keys.device
    rank_in_kernel = k <= RANK_MAX_K
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    columns = torch.empty(rows, k, dtype=torch.int32, device=device)
    overflow = torch.empty(rows, dtype=torch.int8, device=device)
    if rows:
        _topk_of_keys_and_groups_kernel[(rows,)](
            keys, counts, group_logits, offsets, group_ids, recompute, thresholds, values, columns, overflow, width, k,
            capacity, group_logits.shape[0], _LOG2E / temperature, RECOMPUTED_MARGIN,
            GROUP_COLUMNS=group_logits.shape[1], GROUPS_PER_STEP=GROUPS_PER_STEP, RANK_ROWS=RANK_TILE[0][0],
            RANK_COLUMNS=RANK_TILE[0][1], RANK_IN_KERNEL=rank_in_kernel, num_warps=SELECT_WARPS)
    if not rank_in_kernel:
        values, columns = top_of_counted_keys(keys, counts, k, order)
    return values, columns, overflow.bool()
