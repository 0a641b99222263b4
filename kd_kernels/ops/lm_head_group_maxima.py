"""The lm_head matmul whose epilogue also summarizes each row for the teacher's top-k.

A persistent Triton matmul (TMA tiles, programs walking output tiles in groups of row tiles so
weight tiles are reused from L2) writes the float32 logits of columns ``[0, width)`` and, from
the same float32 accumulator, per row:

- per tile of ``BLOCK_N`` columns: the max and the sum of exp at τ, in log2 units
  (``tile_max2``, ``tile_sum2``): the row's logsumexp without reading the logits back;
- per group of ``GROUP_COLUMNS`` columns: the largest logit (``group_max``, before τ). The
  k-th largest group maximum T is a lower bound of the row's k-th largest logit (k distinct
  groups each hold an element ≥ T), and every element ≥ T lies in a group whose maximum is
  ≥ T, so the top-k is found among ~k groups (ops/topk_from_groups.py), not the whole row.

H200, 8192 × 4096 × 151,936 bf16 (benchmarks/triton_matmul_probe.py): 128 × 256 × 64 tiles,
8 warps, 3 stages, the flattened loop: 15.68 ms with the float32 store and these statistics,
against cuBLAS 14.68 (bf16 out) / 15.40 (float32 out); the statistics alone cost ~0.3 %.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .sort_keys import kth_largest_bits, ordered_bits
from .tma import row_tile_descriptor, tma_rows


@dataclasses.dataclass(frozen=True)
class GroupMaximaConfig:
    """Tiles (rows, columns, hidden step), warps, stages, row tiles per L2 group, columns per
    group maximum (divides ``block_n``), the float32 store in two halves (less shared memory),
    the flattened persistent loop (software-pipelined across tiles)."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    group_columns: int = 32
    subtile: bool = True
    flatten: bool = True


def default_config() -> GroupMaximaConfig:
    """Small tiles under the CPU interpreter (several groups per tile, several tiles per row)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return GroupMaximaConfig(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=1, group_m=2,
                                 group_columns=8, subtile=False, flatten=False)
    return GroupMaximaConfig()


@dataclasses.dataclass
class RowSummaries:
    """What the epilogue leaves per row besides the logits: ``tile_max2`` and ``tile_sum2``
    ``[R, tiles]`` float32 (log2 units at τ; their combination is the row's logsumexp / ln 2),
    ``group_max`` ``[R, groups]`` float32 (logits before τ; -inf past ``width``), the group
    width in columns, and ``store_floor`` ``[R]`` int32 or None: where set, a group's logits
    were written only if the ordered bits of its maximum · log2e / τ reach it (None: all were)."""
    tile_max2: torch.Tensor
    tile_sum2: torch.Tensor
    group_max: torch.Tensor
    group_columns: int
    store_floor: Optional[torch.Tensor] = None


@triton.jit
def _tile_position(tile, row_tiles, column_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the ``tile``-th output tile: GROUP_M row tiles share each
    column tile in turn, so a weight tile is read from HBM about once per group."""
    in_group = GROUP_M * column_tiles
    first_row_tile = (tile // in_group) * GROUP_M
    group_rows = tl.minimum(row_tiles - first_row_tile, GROUP_M)
    return first_row_tile + tile % group_rows, (tile % in_group) // group_rows


@triton.jit
def _lm_head_group_maxima_kernel(hidden_desc, weight_desc, logits_desc, logits_ptr, stride_logits, bias_ptr,
                                 tile_max2_ptr, tile_sum2_ptr, group_max_ptr, store_floor_ptr, num_rows, width,
                                 hidden_size, column_tile_start, column_tiles_here, log2e_over_t,
                                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                                 GROUP_COLUMNS: tl.constexpr, SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                                 DOT_PRECISION: tl.constexpr, STORE_ABOVE_FLOOR: tl.constexpr):
    row_tiles = tl.cdiv(num_rows, BLOCK_M)
    column_tiles = tl.cdiv(width, BLOCK_N)
    groups_per_tile: tl.constexpr = BLOCK_N // GROUP_COLUMNS
    num_groups = column_tiles * groups_per_tile
    # the epilogue's tile counter runs apart from the mainloop's: the flattened loop may
    # software-pipeline the next tile's loads under this tile's epilogue
    epilogue_tile = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), row_tiles * column_tiles_here, NUM_PROGRAMS, flatten=FLATTEN):
        row_tile, column_tile = _tile_position(tile, row_tiles, column_tiles_here, GROUP_M)
        column_tile += column_tile_start
        accumulator = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for step in range(0, hidden_size, BLOCK_K):
            a = hidden_desc.load([row_tile * BLOCK_M, step])
            b = weight_desc.load([column_tile * BLOCK_N, step])
            accumulator = tl.dot(a, b.T, accumulator, input_precision=DOT_PRECISION)
        epilogue_tile += NUM_PROGRAMS
        row_tile, column_tile = _tile_position(epilogue_tile, row_tiles, column_tiles_here, GROUP_M)
        column_tile += column_tile_start
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            accumulator += tl.load(bias_ptr + columns, mask=columns < width, other=0.0).to(tl.float32)[None, :]
        if not STORE_ABOVE_FLOOR:
            if SUBTILE:  # two stores of half the columns: half the shared-memory staging
                left, right = tl.split(tl.permute(tl.reshape(accumulator, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                logits_desc.store([row_tile * BLOCK_M, column_tile * BLOCK_N], left)
                logits_desc.store([row_tile * BLOCK_M, column_tile * BLOCK_N + BLOCK_N // 2], right)
            else:
                logits_desc.store([row_tile * BLOCK_M, column_tile * BLOCK_N], accumulator)
        z = tl.where(columns[None, :] < width, accumulator, float("-inf"))
        z2 = z * log2e_over_t
        tile_max2 = tl.max(z2, axis=1)
        safe_max2 = tl.where(tile_max2 == float("-inf"), 0.0, tile_max2)
        tile_sum2 = tl.sum(tl.exp2(z2 - safe_max2[:, None]), axis=1)
        rows_ok = rows < num_rows
        row_offsets = rows.to(tl.int64)
        tl.store(tile_max2_ptr + row_offsets * column_tiles + column_tile, tile_max2, mask=rows_ok)
        tl.store(tile_sum2_ptr + row_offsets * column_tiles + column_tile, tile_sum2, mask=rows_ok)
        group_max = tl.max(tl.reshape(z, (BLOCK_M, groups_per_tile, GROUP_COLUMNS)), axis=2)
        groups = column_tile * groups_per_tile + tl.arange(0, groups_per_tile)
        tl.store(group_max_ptr + row_offsets[:, None] * num_groups + groups[None, :], group_max,
                 mask=rows_ok[:, None])
        if STORE_ABOVE_FLOOR:  # only the groups that can hold the row's top-k: a fraction of the bytes
            floor = tl.load(store_floor_ptr + rows, mask=rows_ok, other=0)
            # the selection's own test: the bits of max · log2e / τ (rounding is monotone)
            kept = ordered_bits(group_max * log2e_over_t) >= floor[:, None]
            group_columns = groups[:, None] * GROUP_COLUMNS + tl.arange(0, GROUP_COLUMNS)[None, :]
            tl.store(logits_ptr + row_offsets[:, None, None] * stride_logits + group_columns[None, :, :],
                     tl.reshape(accumulator, (BLOCK_M, groups_per_tile, GROUP_COLUMNS)),
                     # whole groups (the buffer's rows hold them: `padded_width`): a mask constant along
                     # a group's columns lets the stores be vectorized
                     mask=(kept & rows_ok[:, None] & (groups < tl.cdiv(width, GROUP_COLUMNS))[None, :])[:, :, None])


@triton.jit
def _store_floor_kernel(group_max_ptr, store_floor_ptr, groups, pilot_groups, k, log2e_over_t,
                        PILOT_GROUPS: tl.constexpr):
    """Per row: the k-th largest maximum of the first ``pilot_groups`` groups (ordered bits of
    max · log2e / τ), a lower bound of the row's k-th largest logit."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, PILOT_GROUPS)
    present = group < pilot_groups
    group_max = tl.load(group_max_ptr + row * groups + group, mask=present, other=float("-inf"))
    tl.store(store_floor_ptr + row, kth_largest_bits(ordered_bits(group_max * log2e_over_t), present, k))


def padded_width(width: int) -> int:
    """Row length of the float32 logits buffer: whole 32-column groups (the epilogue's
    conditional stores write whole groups; TMA stores need rows at 16-byte boundaries)."""
    return -(-width // 32) * 32


def epilogue_applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this kernel takes these inputs: 16-bit (float32 would need IEEE products, far
    slower than cuBLAS) with rows TMA can move (a hidden size that is a multiple of 8)."""
    return (hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
            and tma_rows(hidden) and tma_rows(weight))


PILOT_MAX_K = 256  # larger k: a pilot's floor would let most groups through; every logit is stored


def pilot_column_tiles(k: Optional[int], width: int, config: GroupMaximaConfig, row_tiles: int, programs: int) -> int:
    """Column tiles of the pilot (0: none). The pilot's P tiles are stored whole, then ~k·V/(P·BLOCK_N)
    groups of the rest: P near sqrt(k · group_columns / V) of the tiles stores the fewest bytes
    (~22 % at k = 64, V = 151,936), at least 2k groups (a floor near the k-th logit), and of
    the next 16 counts the one whose two launches leave the fewest programs idle at their ends."""
    column_tiles = -(-width // config.block_n)
    if k is None or k > PILOT_MAX_K:
        return 0
    groups_per_tile = config.block_n // config.group_columns
    first = max(math.ceil(math.sqrt(k * config.group_columns / width) * column_tiles),
                -(-2 * k // groups_per_tile))
    if 2 * first > column_tiles:  # no fewer bytes than storing every tile
        return 0

    def idle(tiles):
        return -tiles % programs

    return min(range(first, min(first + 16, column_tiles // 2 + 1)),
               key=lambda pilot: (idle(row_tiles * pilot) + idle(row_tiles * (column_tiles - pilot)), pilot))


def lm_head_logits_with_summaries(hidden: torch.Tensor, weight: torch.Tensor, bias, width: int,
                                  temperature: float, logits: torch.Tensor,
                                  config: GroupMaximaConfig | None = None, pilot_k: Optional[int] = None) -> RowSummaries:
    """hidden ``[R, H]``, weight ``[≥ width, H]`` (bf16 / fp16, or float32 with IEEE products:
    the interpreter's tests), bias ``[≥ width]`` or None -> the float32 logits
    ``hidden @ weight[:width].T + bias`` written into ``logits [R, ≥ width]`` (rows 16-byte
    aligned: `padded_width`), and the rows' `RowSummaries`. With ``pilot_k`` (the k of the
    top-k to come, ≤ PILOT_MAX_K) the first `pilot_column_tiles` are computed first and set
    each row's store floor (the k-th largest of their group maxima: a lower bound of the k-th
    logit); of the remaining tiles only the groups that reach it are written."""
    config = config or default_config()
    num_rows, hidden_size = hidden.shape
    if logits.dtype != torch.float32:
        raise ValueError(f"logits: expected a float32 buffer (rows of padded_width(width)), got {logits.dtype}")
    if config.block_n % config.group_columns:
        raise ValueError(f"config: group_columns {config.group_columns} must divide block_n {config.block_n}")
    if logits.shape[1] < -(-width // config.group_columns) * config.group_columns:
        raise ValueError(f"logits: expected rows of at least padded_width(width) = {padded_width(width)} columns "
                         f"(whole groups), got {logits.shape[1]}")
    column_tiles = -(-width // config.block_n)
    groups_per_tile = config.block_n // config.group_columns
    groups = column_tiles * groups_per_tile
    device = hidden.device
    summaries = RowSummaries(torch.empty(num_rows, column_tiles, dtype=torch.float32, device=device),
                             torch.empty(num_rows, column_tiles, dtype=torch.float32, device=device),
                             torch.empty(num_rows, groups, dtype=torch.float32, device=device), config.group_columns)
    if num_rows == 0:
        return summaries
    row_tiles = -(-num_rows // config.block_m)
    if device.type == "cuda":
        programs = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        programs = 3  # the interpreter: still several tiles per program
    store_columns = config.block_n // 2 if config.subtile else config.block_n
    descriptors = (
        row_tile_descriptor(hidden, "hidden", [config.block_m, config.block_k], "the teacher's epilogue matmul"),
        row_tile_descriptor(weight, "weight", [config.block_n, config.block_k], "the teacher's epilogue matmul"),
        row_tile_descriptor(logits[:, :width], "logits", [config.block_m, store_columns],
                            "the teacher's epilogue matmul"))
    log2e_over_t = 1.4426950408889634 / temperature

    def launch(first_tile, tiles, store_floor):
        _lm_head_group_maxima_kernel[(min(row_tiles * tiles, programs),)](
            *descriptors, logits, logits.stride(0), bias if bias is not None else summaries.tile_max2,
            summaries.tile_max2, summaries.tile_sum2, summaries.group_max,
            store_floor if store_floor is not None else summaries.tile_max2, num_rows, width, hidden_size,
            first_tile, tiles, log2e_over_t,
            HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, NUM_PROGRAMS=min(row_tiles * tiles, programs),
            GROUP_COLUMNS=config.group_columns, SUBTILE=config.subtile, FLATTEN=config.flatten,
            # float32 inputs get float32 products (tf32 would move logits by ~1e-3)
            DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
            STORE_ABOVE_FLOOR=store_floor is not None, num_warps=config.num_warps, num_stages=config.num_stages)

    pilot = pilot_column_tiles(pilot_k, width, config, row_tiles, programs)
    if not pilot:
        launch(0, column_tiles, None)
        return summaries
    launch(0, pilot, None)
    summaries.store_floor = torch.empty(num_rows, dtype=torch.int32, device=device)
    _store_floor_kernel[(num_rows,)](summaries.group_max, summaries.store_floor, groups, pilot * groups_per_tile,
                                     pilot_k, log2e_over_t, PILOT_GROUPS=triton.next_power_of_2(pilot * groups_per_tile))
    launch(pilot, column_tiles - pilot, summaries.store_floor)
    return summaries
