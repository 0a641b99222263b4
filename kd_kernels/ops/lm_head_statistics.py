"""The student's lm_head matmul with the row statistics in its epilogue.

One program per (BLOCK_M rows, BLOCK_N columns) tile: ``tl.dot`` over TMA tiles of hidden
and weight into a float32 accumulator, the tile stored as float32 logits (the gradient pass
reads them), and from the same registers, per row of the tile: the max of ``z = logits +
bias`` over the existing columns, the sum of ``exp(z - max)`` (and of ``exp((z - max) / τ)``),
and the lowest column holding the max. `combine_tiles` turns ``[R, T]`` tile statistics into
the row's logsumexps and argmax. This replaces the statistics pass that read the float32
logits back (4 bytes an element); the gathers at the teacher ids and the label stay separate
(k + 1 reads a row).

Rows past R and columns past ``width`` do not count; the logits buffer's rows must start at
16-byte boundaries (TMA), as must hidden's and weight's.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from .sort_keys import EMPTY_COLUMN
from .tma import row_tile_descriptor

USER = "the matmul with statistics (KD_KERNELS_STUDENT_STATS=epilogue)"


@dataclasses.dataclass(frozen=True)
class StatisticsTiles:
    """Tile sizes (rows, columns, hidden step), warps and pipeline stages."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_tiles() -> StatisticsTiles:
    """Small tiles under the CPU interpreter; ``KD_KERNELS_STATS_TILES="bm,bn,bk,warps,stages"``
    overrides the GPU one (benchmark sweeps)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return StatisticsTiles(16, 32, 16, 1, 1)
    text = os.environ.get("KD_KERNELS_STATS_TILES")
    if not text:
        return StatisticsTiles()
    numbers = [int(part) for part in text.split(",")]
    if len(numbers) != 5:
        raise ValueError(f"KD_KERNELS_STATS_TILES: expected 'bm,bn,bk,warps,stages', got {text!r}")
    return StatisticsTiles(*numbers)


@triton.jit
def _logits_and_statistics_kernel(hidden_desc, weight_desc, logits_desc, bias_ptr, tile_max_ptr, tile_sum_ptr,
                                  tile_sum_tempered_ptr, tile_arg_ptr, num_rows, hidden_size, width, num_tiles,
                                  inv_temperature, HAS_BIAS: tl.constexpr, TEMPERED: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  DOT_PRECISION: tl.constexpr):
    program = tl.program_id(0)
    row_tiles = tl.cdiv(num_rows, BLOCK_M)
    # row tiles fastest: consecutive programs share a weight tile (read once from HBM, then L2)
    row_tile = program % row_tiles
    column_tile = program // row_tiles
    accumulator = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(0, hidden_size, BLOCK_K):
        a = hidden_desc.load([row_tile * BLOCK_M, step])
        b = weight_desc.load([column_tile * BLOCK_N, step])
        accumulator = tl.dot(a, b.T, accumulator, input_precision=DOT_PRECISION)
    logits_desc.store([row_tile * BLOCK_M, column_tile * BLOCK_N], accumulator)
    columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    z = accumulator
    if HAS_BIAS:
        z += tl.load(bias_ptr + columns, mask=columns < width, other=0.0).to(tl.float32)[None, :]
    z = tl.where(columns[None, :] < width, z, float("-inf"))
    tile_max = tl.max(z, axis=1)
    safe_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
    shifted = z - safe_max[:, None]
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < num_rows
    at = rows.to(tl.int64) * num_tiles + column_tile
    tl.store(tile_max_ptr + at, tile_max, mask=rows_ok)
    tl.store(tile_sum_ptr + at, tl.sum(tl.exp(shifted), axis=1), mask=rows_ok)
    if TEMPERED:
        tl.store(tile_sum_tempered_ptr + at, tl.sum(tl.exp(shifted * inv_temperature), axis=1), mask=rows_ok)
    arg = tl.min(tl.where(z == tile_max[:, None], columns[None, :], 2147483647), axis=1)
    tl.store(tile_arg_ptr + at, arg, mask=rows_ok)


@dataclasses.dataclass
class TileStatistics:
    """Per (row, column tile) float32 ``max``, ``total`` (Σ exp(z - max)), ``total_tempered``
    (None at τ = 1) and int32 ``arg`` (lowest column of the max), ``[R, T]``."""
    max: torch.Tensor
    total: torch.Tensor
    total_tempered: torch.Tensor | None
    arg: torch.Tensor


def logits_and_statistics(hidden: torch.Tensor, weight: torch.Tensor, bias, width: int, temperature: float,
                          out: torch.Tensor, tiles: StatisticsTiles | None = None) -> TileStatistics:
    """``out [R, V]`` float32 (rows 16-byte aligned) = ``hidden [R, H] @ weight [V, H].T`` (no bias),
    and each tile's statistics of ``z = out + bias`` over columns ``[0, width)``."""
    tiles = tiles or default_tiles()
    num_rows, hidden_size = hidden.shape
    num_tiles = -(-out.shape[1] // tiles.block_n)
    tempered = temperature != 1.0

    def empty(dtype):
        return torch.empty(num_rows, num_tiles, dtype=dtype, device=hidden.device)

    stats = TileStatistics(empty(torch.float32), empty(torch.float32), empty(torch.float32) if tempered else None,
                           empty(torch.int32))
    if num_rows:
        grid = (-(-num_rows // tiles.block_m) * num_tiles,)
        _logits_and_statistics_kernel[grid](
            row_tile_descriptor(hidden, "hidden", [tiles.block_m, tiles.block_k], USER),
            row_tile_descriptor(weight, "weight", [tiles.block_n, tiles.block_k], USER),
            row_tile_descriptor(out, "logits", [tiles.block_m, tiles.block_n], USER),
            bias if bias is not None else stats.max, stats.max, stats.total,
            stats.total_tempered if tempered else stats.total, stats.arg,
            num_rows, hidden_size, width, num_tiles, 1.0 / temperature,
            HAS_BIAS=bias is not None, TEMPERED=tempered, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return stats


def combine_tiles(stats: TileStatistics, temperature: float, column_start: int = 0):
    """(lse ``[R]``, lse at τ ``[R]`` (the same tensor at τ = 1), row max ``[R]``, argmax ``[R]``
    int64 global column, lowest on ties) from the tiles' statistics."""
    best = stats.max.max(dim=-1).values
    safe_best = torch.where(best == -float("inf"), 0.0, best)
    weights = stats.max - safe_best.unsqueeze(-1)
    lse = safe_best + torch.log((stats.total * torch.exp(weights)).sum(-1))
    lse_tempered = lse
    if stats.total_tempered is not None:
        lse_tempered = safe_best / temperature + torch.log(
            (stats.total_tempered * torch.exp(weights / temperature)).sum(-1))
    top1 = torch.where(stats.max == best.unsqueeze(-1), stats.arg, EMPTY_COLUMN).min(dim=-1).values
    return lse, lse_tempered, best, top1.long() + column_start
