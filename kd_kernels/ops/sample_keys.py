"""Row passes of the teacher's Gumbel-top-n sampling (kd_kernels/teacher_sampling.py): floors from a
strided sample of each row's keys, candidates from stored logits rows, and the ranking of a row's
candidates into its samples.

Candidates are raw keys (a logit's float bits, before τ, bias included, above its global
column), as the sampling matmul (ops/lm_head_sample.py) or `logits_candidates` append them,
each row's count beside them. `noise_candidates` adds each candidate's exact noise
(`noisy_raw_keys`: ``κ = fma(z, 1/τ, G)``, the same float32 key wherever it is computed) and
flags the rows to redo; `rank_noisy_candidates` takes the n + 1 largest keys per row (lower column
first on ties; ops/sort_keys.py) and turns them into log-probs ``(κ − G) − lse`` and the threshold
``κ_{n+1} − lse``. A row is exact when its candidates hold every element whose key is at or above
its floor and at least n + 1 of them are: ``overflow`` flags the others (more candidates than
slots, or fewer than n + 1 keys at or above the floor) for an exact redo, before any row is
ranked.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .gumbel_noise import (coarse_gumbel_lower_bound, global_row, gumbel_noise, noisy_raw_keys,
                           row_key, row_operands, signed_key)
from .launch import ROW_BLOCK_V, THRESHOLD_BISECTIONS, num_warps_for
from .sort_keys import top_of_counted_keys
from .utils import kth_largest_by_removal, kth_largest_lower_bound

ROW_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 4
KEY_BLOCK = 64 if os.environ.get("TRITON_INTERPRET") == "1" else 1024
FLOOR_REMOVALS = 12  # floors of rank up to this by removing maxima (`kth_largest_by_removal`), else bisection
_REMOVALS = tl.constexpr(FLOOR_REMOVALS)
COLLECT_MARGIN = 1.0 / 1024  # `logits_candidates` collects keys down to the floor less this (1 + |floor|)


@triton.jit(do_not_specialize=["seed_key", "first_row"])
def _sample_key_floor_kernel(sample_ptr, stride_row, floors_ptr, sample_width, stride, inv_t, seed_key, rows_ptr,
                             first_row, rank, SAMPLE: tl.constexpr, STEPS: tl.constexpr, ROWS_LISTED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, SAMPLE)
    valid = offsets < sample_width
    z = tl.load(sample_ptr + row * stride_row + offsets, mask=valid, other=0.0).to(tl.float32)
    noise = coarse_gumbel_lower_bound(row_key(seed_key, global_row(rows_ptr, first_row, row, ROWS_LISTED)),
                                      offsets * stride)
    keys = tl.fma(z, inv_t, noise)
    if rank <= _REMOVALS:
        low = kth_largest_by_removal(keys, valid, rank)
    else:
        low = kth_largest_lower_bound(keys, valid, rank, STEPS)
    tl.store(floors_ptr + row, tl.maximum(low, -3.4028234663852886e38))


def sample_key_floors(sample: torch.Tensor, stride: int, rank: int, temperature: float, seed_key: int,
                      global_rows, floors: torch.Tensor, steps: int = 12) -> torch.Tensor:
    """sample ``[R, S]`` logits (any float dtype, unit stride along a row) of the global columns
    ``0, stride, 2·stride, …`` of the global rows ``global_rows`` (`row_operands`) -> ``floors
    [R]`` float32 filled: per row a lower bound of the rank-th largest key ``z / τ + G`` among
    them, never −inf (the most negative float where fewer than rank keys differ). The keys take
    G's coarse lower bound (`coarse_gumbel_lower_bound`), a lower bound of each key: a floor only
    sets how many elements the sampling matmul keeps, and the ranking checks it against the exact
    keys."""
    rows, width = sample.shape
    if rows:
        rows_ptr, first_row, listed = row_operands(global_rows, floors)
        _sample_key_floor_kernel[(rows,)](sample, sample.stride(0), floors, width, stride, 1.0 / temperature,
                                          signed_key(seed_key), rows_ptr, first_row, rank,
                                          SAMPLE=triton.next_power_of_2(width), STEPS=steps, ROWS_LISTED=listed,
                                          num_warps=ROW_WARPS)
    return floors


@triton.jit
def _row_logits(row_ptr, bias_ptr, cols, inside, HAS_BIAS: tl.constexpr):
    z = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
    if HAS_BIAS:
        z = z + tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    return z


@triton.jit
def lanes_floor(lane_key, wanted, collect_margin, BISECTIONS: tl.constexpr):
    """A row's candidate floor from its lanes' largest keys (``[L]`` float32, −inf for an empty
    lane: distinct elements, so at least ``wanted`` keys reach their ``wanted``-th largest T):
    T's lower bound less ``collect_margin · (1 + |T|)``, −inf where fewer lanes hold a key."""
    lanes = lane_key > float("-inf")
    low = kth_largest_lower_bound(lane_key, lanes, wanted, BISECTIONS)
    threshold = tl.where(tl.sum(lanes.to(tl.int32), axis=0) >= wanted, low, float("-inf"))
    return threshold - collect_margin * (1.0 + tl.abs(threshold))


@triton.jit(do_not_specialize=["seed_key", "first_row"])
def _logits_candidates_kernel(logits_ptr, bias_ptr, stride_row, width, keys_ptr, counts_ptr, floors_ptr, lse_ptr,
                              capacity, wanted, inv_t, log2e_over_t, collect_margin, seed_key, rows_ptr, first_row,
                              HAS_BIAS: tl.constexpr, BLOCK_V: tl.constexpr, BISECTIONS: tl.constexpr,
                              ROWS_LISTED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    key = row_key(seed_key, global_row(rows_ptr, first_row, row, ROWS_LISTED))
    offsets = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)  # Σ 2^((z - lane_max) · log2e / τ)
    lane_key = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for start in range(0, width, BLOCK_V):
        cols = start + offsets
        z = _row_logits(row_ptr, bias_ptr, cols, cols < width, HAS_BIAS)
        new_max = tl.maximum(lane_max, z)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp2((lane_max - safe_max) * log2e_over_t) + tl.exp2((z - safe_max) * log2e_over_t)
        lane_max = new_max
        lane_key = tl.maximum(lane_key, tl.fma(z, inv_t, gumbel_noise(key, cols)))
    row_max = tl.max(lane_max, axis=0)
    safe_row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(lane_sum * tl.exp2((lane_max - safe_row_max) * log2e_over_t), axis=0)
    lse = (safe_row_max * log2e_over_t + tl.log2(total)) * 0.6931471805599453
    tl.store(lse_ptr + row, tl.where(row_max == float("-inf"), float("-inf"), lse))
    floor = lanes_floor(lane_key, wanted, collect_margin, BISECTIONS)
    tl.store(floors_ptr + row, floor)
    counter = counts_ptr + row + tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, width, BLOCK_V):
        cols = start + offsets
        inside = cols < width
        z = _row_logits(row_ptr, bias_ptr, cols, inside, HAS_BIAS)
        kappa = tl.fma(z, inv_t, gumbel_noise(key, cols))
        take = inside & (kappa >= floor) & (kappa > float("-inf"))
        slots = tl.atomic_add(counter, 1, mask=take)
        raw = (z.to(tl.int32, bitcast=True).to(tl.int64) << 32) | cols.to(tl.int64)
        tl.store(keys_ptr + row * capacity + slots, raw, mask=take & (slots < capacity))


def logits_capacity(num_samples: int) -> int:
    """Candidate slots a row of `logits_candidates` (a power of two)."""
    return triton.next_power_of_2(max(256, 4 * (num_samples + 1)))


def logits_candidates(logits: torch.Tensor, bias, width: int, num_samples: int, temperature: float, seed_key: int,
                      global_rows, keys: torch.Tensor, counts: torch.Tensor, floors: torch.Tensor,
                      lse: torch.Tensor) -> None:
    """From rows ``logits [R, ≥ width]`` (unit stride along a row; ``bias [≥ width]`` or None
    added) of the global rows ``global_rows`` (`row_operands`): each row's candidates (every key at or
    above a floor under its (n+1)-th largest key, −inf keys never) into ``keys [R, capacity]``
    int64 raw and ``counts [R]`` int32 (zeroed here), the floors into ``floors [R]`` (−inf where
    fewer than n + 1 keys are finite) and ``lse [R]`` float32, logsumexp of ``z / τ``, filled."""
    rows = logits.shape[0]
    counts.zero_()
    if rows:
        rows_ptr, first_row, listed = row_operands(global_rows, lse)
        _logits_candidates_kernel[(rows,)](
            logits, bias if bias is not None else logits, logits.stride(0), width, keys, counts, floors, lse,
            keys.shape[1], num_samples + 1, 1.0 / temperature, math.log2(math.e) / temperature, COLLECT_MARGIN,
            signed_key(seed_key), rows_ptr, first_row, HAS_BIAS=bias is not None, BLOCK_V=ROW_BLOCK_V,
            BISECTIONS=THRESHOLD_BISECTIONS, ROWS_LISTED=listed, num_warps=num_warps_for(ROW_BLOCK_V))


@triton.jit(do_not_specialize=["seed_key", "first_row"])
def _noisy_keys_kernel(keys_ptr, counts_ptr, floors_ptr, overflow_ptr, redo_ptr, redo_rows_ptr, row_base, capacity,
                       wanted, inv_t, seed_key, rows_ptr, first_row, BLOCK: tl.constexpr, ROWS_LISTED: tl.constexpr,
                       LIST_REDO: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    appended = tl.load(counts_ptr + row)
    count = tl.minimum(appended, capacity)
    floor = tl.load(floors_ptr + row)
    key = row_key(seed_key, global_row(rows_ptr, first_row, row, ROWS_LISTED))
    reached = tl.zeros([BLOCK], tl.int32)
    for start in range(0, count, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        filled = slot < count
        raw = tl.load(keys_ptr + row * capacity + slot, mask=filled, other=0)
        noisy, kappa = noisy_raw_keys(raw, inv_t, key)
        tl.store(keys_ptr + row * capacity + slot, noisy, mask=filled)
        reached += (filled & (kappa >= floor)).to(tl.int32)
    # fewer than n + 1 keys at or above the floor: the (n+1)-th largest key is below it (a −inf
    # floor: a row of fewer than n + 1 finite keys, all of them samples)
    overflow = (appended > capacity) | ((tl.sum(reached, axis=0) < wanted) & (floor > float("-inf")))
    tl.store(overflow_ptr + row, overflow)
    if LIST_REDO:
        slot = tl.atomic_add(redo_ptr, 1, mask=overflow, sem="relaxed")
        tl.store(redo_rows_ptr + slot, (row_base + row).to(tl.int32), mask=overflow)


@triton.jit(do_not_specialize=["seed_key", "first_row"])
def _finish_samples_kernel(values_ptr, columns_ptr, lse_ptr, logprobs_ptr, ids_ptr, threshold_ptr, samples, seed_key,
                           rows_ptr, first_row, TOP: tl.constexpr, ROWS_LISTED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rank = tl.arange(0, TOP)
    inside = rank < samples
    kappa = tl.load(values_ptr + row * (samples + 1) + rank, mask=inside, other=float("-inf"))
    column = tl.load(columns_ptr + row * (samples + 1) + rank, mask=inside, other=0)
    lse = tl.load(lse_ptr + row)
    found = kappa > float("-inf")
    noise = gumbel_noise(row_key(seed_key, global_row(rows_ptr, first_row, row, ROWS_LISTED)), column)
    logprobs = tl.where(found, (kappa - noise) - lse, float("-inf"))
    tl.store(logprobs_ptr + row * samples + rank, logprobs, mask=inside)
    tl.store(ids_ptr + row * samples + rank, tl.where(found, column, 0), mask=inside)
    kth = tl.load(values_ptr + row * (samples + 1) + samples)
    tl.store(threshold_ptr + row, tl.where(kth > float("-inf"), kth - lse, float("-inf")))


def noise_candidates(keys: torch.Tensor, counts: torch.Tensor, floors: torch.Tensor, num_samples: int,
                     temperature: float, seed_key: int, global_rows, overflow: torch.Tensor, redo=None,
                     row_base: int = 0) -> None:
    """The global rows ``global_rows``' (`row_operands`) raw candidates ``keys [R, capacity]``
    made noisy keys in place (``counts [R]`` of them, which may pass the capacity), and
    ``overflow [R]`` bool filled: more candidates than slots, or fewer than n + 1 keys at or
    above the row's floor (``floors [R]``), the rows to redo exactly. ``redo``: None, or
    (``count [1]`` int32, ``rows [≥ count + R]`` int32): each flagged row ``r`` takes the next
    slot of the list, ``rows[count] = row_base + r`` (in no set order), ``count`` + 1."""
    rows, capacity = keys.shape
    if not rows:
        return
    rows_ptr, first_row, listed = row_operands(global_rows, counts)
    redo_count, redo_rows = redo if redo is not None else (counts, counts)
    _noisy_keys_kernel[(rows,)](keys, counts, floors, overflow, redo_count, redo_rows, row_base, capacity,
                                num_samples + 1, 1.0 / temperature, signed_key(seed_key), rows_ptr, first_row,
                                BLOCK=KEY_BLOCK, ROWS_LISTED=listed, LIST_REDO=redo is not None, num_warps=ROW_WARPS)


def rank_noisy_candidates(keys: torch.Tensor, counts: torch.Tensor, lse: torch.Tensor, num_samples: int,
                          seed_key: int, global_rows, order: str, outputs) -> None:
    """Noisy candidates (`noise_candidates`'s ``keys`` and ``counts``) and ``lse [R]`` (natural
    units at τ) -> ``outputs`` = (log-probs ``[R, n]`` float32, ids ``[R, n]`` int32, thresholds
    ``[R]`` float32) filled. ``order``: "cuda" | "triton" (`top_of_counted_keys`)."""
    logprobs, ids, thresholds = outputs
    rows, capacity = keys.shape
    if not rows:
        return
    rows_ptr, first_row, listed = row_operands(global_rows, counts)
    # the triton order reads counts past the capacity as the capacity
    values, columns = top_of_counted_keys(keys, counts if order == "triton" else counts.clamp(max=capacity),
                                          num_samples + 1, order)
    _finish_samples_kernel[(rows,)](values, columns, lse, logprobs, ids, thresholds, num_samples,
                                    signed_key(seed_key), rows_ptr, first_row, TOP=triton.next_power_of_2(num_samples),
                                    ROWS_LISTED=listed, num_warps=ROW_WARPS)


def rank_samples(keys: torch.Tensor, counts: torch.Tensor, floors: torch.Tensor, lse: torch.Tensor, num_samples: int,
                 temperature: float, seed_key: int, global_rows, order: str, outputs) -> None:
    """`noise_candidates` then `rank_noisy_candidates`: ``outputs`` = (log-probs, ids,
    thresholds, overflow) filled."""
    noise_candidates(keys, counts, floors, num_samples, temperature, seed_key, global_rows, outputs[3])
    rank_noisy_candidates(keys, counts, lse, num_samples, seed_key, global_rows, order, outputs[:3])
