"""The teacher's top-k fused into the lm_head matmul: no float32 logits in memory.

One program per (tile of BLOCK_M rows, vocab split). It walks its split tile by tile of
BLOCK_N columns; each tile's logits come from ``tl.dot`` into a float32 accumulator and never
leave the program. Its epilogue keeps, per row, the online max and sum of exp at τ, and
appends the (value, column) pairs above the row's running threshold to the row's ``C``
candidate slots. When a row's slots could not take another tile, the program sorts them by
one 64-bit key (`sort_keys`: value descending, then the lower column), keeps the k largest
and raises the threshold to the k-th: an element equal to it later loses to the k kept, which
are at least as large and have lower columns, so the selection is exact, with no overflow
path. At the split's end the slots hold its top-k in order.

Outputs per (row, split): the top-k (the first k of ``[N, S, C]`` float32 values and int32
columns) and (max, sum of exp) of the tempered logits; `teacher_chunked.teacher_topk_fused`
merges the splits. Memory: ``N · S · C · 8`` bytes plus ``N · S · 8`` — no term in V.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from .launch import multiprocessor_count
from .sort_keys import EMPTY_COLUMN, value_column_key, value_of_key
from .tma import row_tile_descriptor

_EMPTY_COLUMN = tl.constexpr(EMPTY_COLUMN)

FUSED_MAX_K = 256  # each row's k + BLOCK_N candidate slots are sorted inside the kernel


@dataclasses.dataclass(frozen=True)
class FusedTopKConfig:
    """Tile sizes of the fused kernel (rows, vocab columns, hidden step), warps, pipeline
    stages, and vocab splits (None: enough programs for two per SM)."""
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    splits: int | None = None


def default_config() -> FusedTopKConfig:
    """Small tiles under the CPU interpreter; ``KD_KERNELS_FUSED_TOPK="bm,bn,bk,warps,stages[,splits]"``
    overrides the GPU one (the benchmark's sweeps)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return FusedTopKConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
    text = os.environ.get("KD_KERNELS_FUSED_TOPK")
    if not text:
        return FusedTopKConfig()
    numbers = [int(part) for part in text.split(",")]
    if len(numbers) not in (5, 6):
        raise ValueError(f"KD_KERNELS_FUSED_TOPK: expected 'bm,bn,bk,warps,stages[,splits]', got {text!r}")
    return FusedTopKConfig(*numbers)


def slots_per_row(k: int, block_n: int) -> int:
    """C: room for the k kept and one whole tile, a power of two (``tl.sort``)."""
    return triton.next_power_of_2(k + block_n)


@triton.jit
def _keep_top_k(values_ptr, columns_ptr, rows, rows_ok, count, k, limit, BLOCK_M: tl.constexpr, C: tl.constexpr,
                SPLITS: tl.constexpr):
    """Rows whose count exceeds ``limit``: sorts their C slots (value descending, lower column
    first) in place, one row at a time (a [BLOCK_M, C] sort would not fit in registers).
    Returns (per row: the k-th kept value, or -inf where fewer than k are kept or the row was
    not sorted; the new counts: min(count, k) for the sorted rows)."""
    tl.debug_barrier()  # the appends of every thread are in memory
    split = tl.program_id(1)
    positions = tl.arange(0, C)
    lanes = tl.arange(0, BLOCK_M)
    kth_values = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for lane in range(BLOCK_M):
        row = tl.sum(tl.where(lanes == lane, rows, 0))
        row_count = tl.sum(tl.where(lanes == lane, count, 0))
        row_ok = tl.sum(tl.where(lanes == lane, rows_ok.to(tl.int32), 0)) > 0
        if row_ok & (row_count > limit):
            offsets = (row.to(tl.int64) * SPLITS + split) * C + positions
            filled = positions < row_count
            keys = value_column_key(tl.load(values_ptr + offsets, mask=filled, other=float("-inf")),
                         tl.load(columns_ptr + offsets, mask=filled, other=_EMPTY_COLUMN))
            keys = tl.sort(keys, descending=True)
            tl.debug_barrier()  # every thread has read before any overwrites
            tl.store(values_ptr + offsets, value_of_key(keys))
            tl.store(columns_ptr + offsets, (0xFFFFFFFF - (keys & 0xFFFFFFFF)).to(tl.int32))
            kth = value_of_key(tl.sum(tl.where(positions == k - 1, keys, 0), axis=0))  # the one k-th key
            kth_values = tl.where((lanes == lane) & (row_count >= k), kth, kth_values)
    tl.debug_barrier()
    return kth_values, tl.where(rows_ok & (count > limit), tl.minimum(count, k), count)


@triton.jit
def _lm_head_topk_kernel(hidden_desc, weight_desc, bias_ptr, values_ptr, columns_ptr, row_max_ptr, row_sum_ptr,
                         num_rows, hidden_size, width, split_columns, k, inv_temperature,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, C: tl.constexpr, SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    row_tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < num_rows
    tile_columns = tl.arange(0, BLOCK_N)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)  # Σ 2^((z - row_max) · log2e), z tempered
    count = tl.zeros([BLOCK_M], tl.int32)
    threshold = tl.full([BLOCK_M], float("-inf"), tl.float32)
    split_start = split * split_columns
    split_stop = tl.minimum(split_start + split_columns, width)
    for tile_start in range(split_start, split_stop, BLOCK_N):
        columns = tile_start + tile_columns
        columns_ok = columns < split_stop
        accumulator = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # TMA tiles (zero past the tensors' ends): a pipelined mainloop without pointer tensors
        for step in range(0, hidden_size, BLOCK_K):
            a = hidden_desc.load([row_tile * BLOCK_M, step])
            b = weight_desc.load([tile_start, step])
            accumulator = tl.dot(a, b.T, accumulator, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            accumulator += tl.load(bias_ptr + columns, mask=columns_ok, other=0.0).to(tl.float32)[None, :]
        z = tl.where(columns_ok[None, :], accumulator * inv_temperature, float("-inf"))  # tempered
        z2 = z * 1.4426950408889634  # log2 units for the sums
        new_max = tl.maximum(row_max, tl.max(z2, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp2(row_max - safe_max) + tl.sum(tl.exp2(z2 - safe_max[:, None]), axis=1)
        row_max = new_max
        # strict: a later element equal to the threshold loses to the k kept (lower columns)
        take = (z > threshold[:, None]) & rows_ok[:, None]
        taken = tl.sum(take.to(tl.int32), axis=1)
        if tl.max(taken, axis=0) > 0:  # after the first tiles, most tiles append nothing
            slot = (rows.to(tl.int64)[:, None] * SPLITS + split) * C + count[:, None] + \
                tl.cumsum(take.to(tl.int32), axis=1) - 1
            tl.store(values_ptr + slot, z, mask=take)
            tl.store(columns_ptr + slot, columns[None, :] + tl.zeros([BLOCK_M, BLOCK_N], tl.int32), mask=take)
            count += taken
            if tl.max(count, axis=0) > C - BLOCK_N:  # a row could not take another tile
                kth, count = _keep_top_k(values_ptr, columns_ptr, rows, rows_ok, count, k, C - BLOCK_N, BLOCK_M, C,
                                         SPLITS)
                threshold = tl.maximum(threshold, kth)
    # the split's top-k, in order, in the first k slots (past a row's count: -inf at EMPTY_COLUMN)
    _keep_top_k(values_ptr, columns_ptr, rows, rows_ok, count, k, -1, BLOCK_M, C, SPLITS)
    tl.store(row_max_ptr + rows * SPLITS + split, row_max, mask=rows_ok)
    tl.store(row_sum_ptr + rows * SPLITS + split, row_sum, mask=rows_ok)


def _splits(num_rows: int, width: int, config: FusedTopKConfig, device) -> int:
    if config.splits is not None:
        return max(1, config.splits)
    if device.type != "cuda":
        return 2  # the interpreter: still more than one split, to test the merge
    programs = 2 * multiprocessor_count(device)
    row_tiles = -(-num_rows // config.block_m)
    return max(1, min(-(-programs // row_tiles), -(-width // config.block_n)))


def lm_head_topk_splits(hidden: torch.Tensor, weight: torch.Tensor, bias, k: int, temperature: float, width: int,
                        config: FusedTopKConfig | None = None):
    """hidden ``[N, H]``, weight ``[≥ width, H]`` (same dtype, rows contiguous), bias ``[≥ width]``
    or None -> each split's top-k of ``(hidden @ weight.T + bias) / τ`` over columns
    ``[0, width)``: values ``[N, S, k]`` float32 (descending; -inf past the split's columns) and
    columns ``[N, S, k]`` int32 (EMPTY_COLUMN there); row max ``[N, S]`` and sum ``[N, S]``
    float32 with ``(max + log2(sum)) · ln 2`` = the split's logsumexp (max in log2 units)."""
    config = config or default_config()
    num_rows, hidden_size = hidden.shape
    splits = _splits(num_rows, width, config, hidden.device)
    tiles = -(-width // config.block_n)
    split_columns = -(-tiles // splits) * config.block_n
    splits = -(-width // split_columns)  # no empty split
    slots = slots_per_row(k, config.block_n)
    values = torch.empty(num_rows, splits, slots, dtype=torch.float32, device=hidden.device)
    columns = torch.empty(num_rows, splits, slots, dtype=torch.int32, device=hidden.device)
    row_max = torch.empty(num_rows, splits, dtype=torch.float32, device=hidden.device)
    row_sum = torch.empty(num_rows, splits, dtype=torch.float32, device=hidden.device)
    if num_rows:
        grid = (-(-num_rows // config.block_m), splits)
        _lm_head_topk_kernel[grid](
            row_tile_descriptor(hidden, "hidden", [config.block_m, config.block_k], "fused=True"),
            row_tile_descriptor(weight, "weight", [config.block_n, config.block_k], "fused=True"),
            bias if bias is not None else values, values, columns, row_max, row_sum,
            num_rows, hidden_size, width, split_columns, k, 1.0 / temperature,
            HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            C=slots, SPLITS=splits,
            # float32 inputs get float32 products (tf32 would move logits by ~1e-3)
            DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages)
    return values[:, :, :k], columns[:, :, :k], row_max, row_sum
