"""The exact redo of listed rows from hidden states, sized on the device: the appended sampling
schedule (kd_kernels/teacher_sampling.py) lists the rows its floors cannot finish exactly
(ops/sample_keys.py `noise_candidates`), and these kernels redo every listed row by the logits
schedule's two passes (`logits_candidates`) without storing logits and without the host knowing
how many rows there are: each kernel reads the count from device memory and its programs exit at
once where it is zero, so the call needs no host sync.

Work items are (a block of BLOCK_M listed rows, a slice of SLICE columns), taken in turn by a
persistent grid, so that a single listed row spreads over every SM. Each item makes its logits
tile by tile (the gathered hidden rows times the slice's lm_head rows, float32 sums), then:
- pass 1: the slice's share of the row's logsumexp (its maximum and sum of exponentials, log2
  units at τ), and every key ``κ = fma(z, 1/τ, G)`` into its lane's maximum (lane = column mod
  LANES; one float atomic maximum an element, the lanes shared by all of a row's slices);
- between the passes, per listed row: the logsumexp and the floor of its lanes (`lanes_floor`);
- pass 2: every key at or above the floor appended to the row's candidates;
- per listed row, its candidates' exact keys sorted (`rank_samples`' order) and the n + 1 largest
  written back in place as its samples. A listed row whose candidates pass their slots (hundreds
  of keys equal in float32: logits of ~1e9, where the noise is lost in rounding) gets NaN
  log-probs and threshold and ids 0: no exact samples exist to write, and the host is not asked.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .buffers import empty_parts
from .gumbel_noise import gumbel_noise, noisy_raw_keys, row_key, signed_key
from .launch import INTERPRETED, THRESHOLD_BISECTIONS, multiprocessor_count
from .sample_keys import COLLECT_MARGIN, lanes_floor, logits_capacity
from .sort_keys import EMPTY_KEY, value_column_key, value_of_key
from .utils import row_logsumexp

# (rows, columns, hidden step) of a tile, and the columns of a work item's slice
BLOCK_M, BLOCK_N, BLOCK_K, SLICE = (16, 16, 16, 32) if INTERPRETED else (16, 128, 64, 1024)
WARPS = 1 if INTERPRETED else 4


@triton.jit
def _round_count(count_ptr, slot_start, slots):
    """The listed rows of this round: those of slots ``slot_start`` to ``slot_start + slots``."""
    return tl.minimum(tl.maximum(tl.load(count_ptr) - slot_start, 0), slots)


@triton.jit(do_not_specialize=["seed_key", "row_offset", "slot_start"])
def _redo_pass_kernel(hidden_ptr, stride_hidden, weight_ptr, stride_weight, bias_ptr, width, hidden_size, rows_ptr,
                      count_ptr, slot_start, slots, lane_keys_ptr, slice_max2_ptr, slice_sum2_ptr, floors_ptr, keys_ptr,
                      counts_ptr, capacity, inv_t, log2e_over_t, seed_key, row_offset, CANDIDATES: tl.constexpr,
                      HAS_BIAS: tl.constexpr, LANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SLICE: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    count = _round_count(count_ptr, slot_start, slots)
    slices = tl.cdiv(width, SLICE)
    steps = tl.arange(0, BLOCK_K)
    for item in range(tl.program_id(0), tl.cdiv(count, BLOCK_M) * slices, NUM_PROGRAMS):
        part = item % slices
        local = (item // slices) * BLOCK_M + tl.arange(0, BLOCK_M)  # the round's slots
        listed = local < count
        rows = tl.load(rows_ptr + slot_start + local, mask=listed, other=0).to(tl.int64)
        key = row_key(seed_key, row_offset + rows)[:, None]
        if CANDIDATES:
            floor = tl.load(floors_ptr + local, mask=listed, other=float("inf"))[:, None]
        run_max2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        run_sum2 = tl.zeros([BLOCK_M], tl.float32)
        for start in range(part * SLICE, tl.minimum(part * SLICE + SLICE, width), BLOCK_N):
            columns = start + tl.arange(0, BLOCK_N)
            inside = columns < width
            accumulator = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for step in range(0, hidden_size, BLOCK_K):
                depth = (step + steps) < hidden_size
                a = tl.load(hidden_ptr + rows[:, None] * stride_hidden + (step + steps)[None, :],
                            mask=listed[:, None] & depth[None, :], other=0.0)
                b = tl.load(weight_ptr + columns[:, None].to(tl.int64) * stride_weight + (step + steps)[None, :],
                            mask=inside[:, None] & depth[None, :], other=0.0)
                accumulator = tl.dot(a, tl.trans(b), accumulator, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                accumulator += tl.load(bias_ptr + columns, mask=inside, other=0.0).to(tl.float32)[None, :]
            z = tl.where(inside[None, :], accumulator, float("-inf"))
            kappa = tl.fma(z, inv_t, gumbel_noise(key, columns[None, :]))
            take = listed[:, None] & inside[None, :]
            if CANDIDATES:
                take = take & (kappa >= floor) & (kappa > float("-inf"))
                counter = counts_ptr + local[:, None] + tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
                slot = tl.atomic_add(counter, 1, mask=take)
                raw = (z.to(tl.int32, bitcast=True).to(tl.int64) << 32) | columns[None, :].to(tl.int64)
                tl.store(keys_ptr + local[:, None].to(tl.int64) * capacity + slot, raw, mask=take & (slot < capacity))
            else:
                tl.atomic_max(lane_keys_ptr + local[:, None].to(tl.int64) * LANES + (columns % LANES)[None, :],
                              kappa, mask=take)
                z2 = z * log2e_over_t
                new_max2 = tl.maximum(run_max2, tl.max(z2, axis=1))
                safe_max2 = tl.where(new_max2 == float("-inf"), 0.0, new_max2)
                run_sum2 = (run_sum2 * tl.exp2(run_max2 - safe_max2)
                            + tl.sum(tl.exp2(z2 - safe_max2[:, None]), axis=1))
                run_max2 = new_max2
        if not CANDIDATES:
            tl.store(slice_max2_ptr + local * slices + part, run_max2, mask=listed)
            tl.store(slice_sum2_ptr + local * slices + part, run_sum2, mask=listed)


@triton.jit
def _redo_start_kernel(count_ptr, slot_start, slots, lane_keys_ptr, counts_ptr, LANES: tl.constexpr,
                       NUM_PROGRAMS: tl.constexpr):
    for local in range(tl.program_id(0), _round_count(count_ptr, slot_start, slots), NUM_PROGRAMS):
        tl.store(lane_keys_ptr + local * LANES + tl.arange(0, LANES), tl.full([LANES], float("-inf"), tl.float32))
        tl.store(counts_ptr + local, 0)


@triton.jit(do_not_specialize=["slot_start"])
def _redo_floors_kernel(count_ptr, slot_start, slots, lane_keys_ptr, slice_max2_ptr, slice_sum2_ptr, slices,
                        floors_ptr, lse_ptr, wanted, collect_margin, LANES: tl.constexpr, SLICES: tl.constexpr,
                        BISECTIONS: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    for local in range(tl.program_id(0), _round_count(count_ptr, slot_start, slots), NUM_PROGRAMS):
        lane_key = tl.load(lane_keys_ptr + local * LANES + tl.arange(0, LANES))
        tl.store(floors_ptr + local, lanes_floor(lane_key, wanted, collect_margin, BISECTIONS))
        row_logsumexp(slice_max2_ptr, slice_sum2_ptr, lse_ptr, local, slices, SLICES)


@triton.jit(do_not_specialize=["seed_key", "row_offset", "slot_start"])
def _redo_rank_kernel(count_ptr, slot_start, slots, rows_ptr, row_offset, keys_ptr, counts_ptr, lse_ptr, samples,
                      inv_t, seed_key, logprobs_ptr, ids_ptr, thresholds_ptr, out_lse_ptr, empty_key,
                      CAPACITY: tl.constexpr, TOP: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    slot = tl.arange(0, CAPACITY)
    rank = tl.arange(0, TOP)
    for local in range(tl.program_id(0), _round_count(count_ptr, slot_start, slots), NUM_PROGRAMS):
        row = tl.load(rows_ptr + slot_start + local).to(tl.int64)
        key = row_key(seed_key, row_offset + row)
        appended = tl.load(counts_ptr + local)
        filled = slot < tl.minimum(appended, CAPACITY)
        row_keys = keys_ptr + local * CAPACITY
        raw = tl.load(row_keys + slot, mask=filled, other=0)
        _, kappa = noisy_raw_keys(raw, inv_t, key)
        ordered = tl.where(filled, value_column_key(kappa, (raw & 0xFFFFFFFF).to(tl.int32)), empty_key)
        tl.store(row_keys + slot, tl.sort(ordered, descending=True))
        tl.debug_barrier()  # the sorted keys stored before the first n + 1 are read back
        top = tl.load(row_keys + rank)
        kappa = value_of_key(top)
        column = (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int32)
        found = kappa > float("-inf")
        lse = tl.load(lse_ptr + local)
        tied = appended > CAPACITY  # more candidates than slots: no exact samples
        logprobs = tl.where(found, (kappa - gumbel_noise(key, column)) - lse, float("-inf"))
        tl.store(logprobs_ptr + row * samples + rank, tl.where(tied, float("nan"), logprobs), mask=rank < samples)
        tl.store(ids_ptr + row * samples + rank, tl.where(found & ~tied, column, 0), mask=rank < samples)
        kth = tl.max(tl.where(rank == samples, kappa, float("-inf")), axis=0)
        threshold = tl.where(kth > float("-inf"), kth - lse, float("-inf"))
        tl.store(thresholds_ptr + row, tl.where(tied, float("nan"), threshold))
        tl.store(out_lse_ptr + row, lse)


def redo_slot_bytes(width: int, num_samples: int) -> int:
    """Work memory a listed row takes in a round of `redo_listed_rows`."""
    return 12 * logits_capacity(num_samples) + 8 * triton.cdiv(width, SLICE) + 12


def redo_listed_rows(hidden: torch.Tensor, weight: torch.Tensor, bias, width: int, num_samples: int,
                     temperature: float, seed_key: int, row_offset: int, rows: torch.Tensor, count: torch.Tensor,
                     outputs, lse: torch.Tensor, budget_bytes: int) -> None:
    """Rows ``rows[:count]`` (``rows [N]`` int32 indices into ``hidden [N, H]``, 16-bit; ``count
    [1]`` int32 on the device, never read by the host) of the teacher sample redone exactly:
    their log-probs, ids and thresholds (``outputs``, each ``[N, …]``) and ``lse [N]`` written
    in place, by the logits schedule's passes from hidden states, the global row of index r
    being ``row_offset + r``; the ranking's order is `rank_samples`' (value descending, then the
    lower column). In rounds of as many listed rows as ``budget_bytes`` of work memory holds
    (`redo_slot_bytes`), each launched whatever the count."""
    num_rows, device = hidden.shape[0], hidden.device
    capacity = logits_capacity(num_samples)
    slots = max(1, min(num_rows, budget_bytes // redo_slot_bytes(width, num_samples)))
    slices = triton.cdiv(width, SLICE)
    lane_keys, slice_max2, slice_sum2, floors, slot_lse, counts, keys = empty_parts(
        device, ((slots, capacity), torch.float32), ((slots, slices), torch.float32), ((slots, slices), torch.float32),
        ((slots,), torch.float32), ((slots,), torch.float32), ((slots,), torch.int32), ((slots, capacity), torch.int64))
    programs = multiprocessor_count(device) if device.type == "cuda" else 3  # the interpreter: several items a program
    key, inv_t, log2e_over_t = signed_key(seed_key), 1.0 / temperature, math.log2(math.e) / temperature
    common = dict(LANES=capacity, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SLICE=SLICE, NUM_PROGRAMS=programs,
                  HAS_BIAS=bias is not None, num_warps=WARPS,
                  DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32")
    logprobs, ids, thresholds = outputs[:3]
    for slot_start in range(0, num_rows, slots):
        _redo_start_kernel[(programs,)](count, slot_start, slots, lane_keys, counts, LANES=capacity,
                                        NUM_PROGRAMS=programs)
        for candidates in (False, True):
            _redo_pass_kernel[(programs,)](
                hidden, hidden.stride(0), weight, weight.stride(0), bias if bias is not None else floors, width,
                hidden.shape[1], rows, count, slot_start, slots, lane_keys, slice_max2, slice_sum2, floors, keys,
                counts, capacity, inv_t, log2e_over_t, key, row_offset, CANDIDATES=candidates, **common)
            if not candidates:
                _redo_floors_kernel[(programs,)](
                    count, slot_start, slots, lane_keys, slice_max2, slice_sum2, slices, floors, slot_lse,
                    num_samples + 1, COLLECT_MARGIN, LANES=capacity, SLICES=triton.next_power_of_2(slices),
                    BISECTIONS=THRESHOLD_BISECTIONS, NUM_PROGRAMS=programs, num_warps=WARPS)
        _redo_rank_kernel[(programs,)](count, slot_start, slots, rows, row_offset, keys, counts, slot_lse, num_samples,
                                       inv_t, key, logprobs, ids, thresholds, lse, EMPTY_KEY, CAPACITY=capacity,
                                       TOP=triton.next_power_of_2(num_samples + 1), NUM_PROGRAMS=programs,
                                       num_warps=WARPS)
