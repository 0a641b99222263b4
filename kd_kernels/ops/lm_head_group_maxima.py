"""The lm_head matmul whose epilogue also summarizes each row for the teacher's top-k.

A persistent Triton matmul (TMA tiles, programs walking output tiles in groups of row tiles so
weight tiles are reused from L2) computes ``hidden @ weight[:width].T (+ bias)`` in a float32
accumulator and leaves, per row:

- per tile of ``BLOCK_N`` columns: the max and the sum of exp at τ, in log2 units
  (``tile_max2``, ``tile_sum2``): the row's logsumexp without reading the logits back;
- with ``group_top2`` (the maxima schedule), per group of ``GROUP_COLUMNS`` columns: the
  largest logit, its lane and the second largest, over groups that interleave so that one
  thread of the matrix units holds a whole group (`RowSummaries`,
  ops/topk_from_group_top2.py); no logits are stored;
- with `Appends` (the appended schedule), every element at or above the row's floor appended
  to the row's keys (ops/topk_from_appended.py); no logits are stored;
- otherwise the logits themselves, in float32 or the inputs' dtype, and each group's maximum;
  or, ``summaries=False``, the logits alone (the appended schedules' floors sample of every
  stride-th column).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .buffers import empty_parts
from .launch import INTERPRETED, multiprocessor_count
from .tma import row_tile_descriptor, tma_rows
from .utils import LOG2E


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
    """Small tiles under the CPU interpreter (several groups per tile, several tiles per row).
    One frozen instance each: made once, not on every call's host path."""
    return _config(INTERPRETED)


@functools.lru_cache(maxsize=None)
def _config(interpreted: bool) -> GroupMaximaConfig:
    if interpreted:
        return GroupMaximaConfig(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=1, group_m=2,
                                 group_columns=8, subtile=False, flatten=False)
    return GroupMaximaConfig()


@dataclasses.dataclass
class RowSummaries:
    """What the epilogue leaves per row besides the logits: ``tile_max2`` and ``tile_sum2``
    ``[R, tiles]`` float32 (log2 units at τ; their combination is the row's logsumexp / ln 2),
    ``group_max`` ``[R, groups]`` float32 (logits before τ; -inf past ``width``), the group
    width in columns and, from a matmul asked for them (``group_top2``), ``group_arg``
    ``[R, groups]`` int8 (the maximum's lane within its group; any of them on a tie) and
    ``group_second`` ``[R, groups]`` float32 (the largest of the group's other lanes: equal to
    the maximum on a tie): a group whose second is below a row's k-th value holds one top-k
    element at most, whose value and column are then known without reading the logits. The
    groups of a ``group_top2`` matmul interleave (`top2_group_columns`: a group is what one
    thread of the matrix units holds); the others are runs of ``group_columns`` columns."""
    tile_max2: torch.Tensor
    tile_sum2: torch.Tensor
    group_max: torch.Tensor
    group_columns: int
    group_arg: torch.Tensor | None = None
    group_second: torch.Tensor | None = None


@dataclasses.dataclass
class Appends:
    """Where an appending matmul puts each row's elements at or above the row's floor:
    ``floors [R]`` float32 (logits before τ, bias included), ``keys [R, capacity]`` int64
    (raw: the float's bits above the column, in no order, as the row sorts take them; slots past
    a row's count are junk), ``counts [R]`` int32 (zero before the matmul; after it, the
    elements at or above the floor, which may pass the capacity: such a row's keys are
    incomplete)."""
    floors: torch.Tensor
    keys: torch.Tensor
    counts: torch.Tensor

    def operands(self) -> tuple:
        return self.floors, self.keys, self.counts, self.keys.shape[1]


@triton.jit
def _tile_position(tile, row_tiles, column_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the ``tile``-th output tile: GROUP_M row tiles share each
    column tile in turn, so a weight tile is read from HBM about once per group."""
    in_group = GROUP_M * column_tiles
    first_row_tile = (tile // in_group) * GROUP_M
    group_rows = tl.minimum(row_tiles - first_row_tile, GROUP_M)
    return first_row_tile + tile % group_rows, (tile % in_group) // group_rows


@triton.jit
def _combine_top2(max_a, arg_a, second_a, max_b, arg_b, second_b):
    # (maximum, its lane, second largest) of two parts: on a tie the second equals the maximum,
    # so the lane matters only where the maximum is unique
    return (tl.maximum(max_a, max_b), tl.where(max_b > max_a, arg_b, arg_a),
            tl.maximum(tl.minimum(max_a, max_b), tl.maximum(second_a, second_b)))


@triton.jit
def _thread_groups(z, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_COLUMNS: tl.constexpr):
    """``z`` [BLOCK_M, BLOCK_N] -> [BLOCK_M, groups, GROUP_COLUMNS]: group 4·h + q holds columns
    4·GROUP_COLUMNS·h + 8·j + 2·q + b (lane 2·j + b; j < GROUP_COLUMNS / 2, b < 2). A thread of the
    Hopper matrix units' accumulator holds a row's columns 8·j + 2·q + b for one q, so a group is
    reduced in registers, with no shuffles (contiguous groups would need shuffle reductions)."""
    halves: tl.constexpr = BLOCK_N // (4 * GROUP_COLUMNS)
    z5 = tl.reshape(z, (BLOCK_M, halves, GROUP_COLUMNS // 2, 4, 2))
    return tl.reshape(tl.permute(z5, (0, 1, 3, 2, 4)), (BLOCK_M, halves * 4, GROUP_COLUMNS))


@triton.jit
def top2_group_pairs(group, pair, GROUP_COLUMNS: tl.constexpr):
    """The index (column / 2, int32) of pair ``pair`` (lanes 2·pair and 2·pair + 1) of group
    ``group`` of a `group_top2` matmul (`_thread_groups`): each run of 4 groups covers
    2 · GROUP_COLUMNS pairs, and group 4·r + q of it every 4th pair from pair q of the run on
    (`top2_group_columns` / 2 of lane 2·pair). Linear in its arguments (no shift), so products
    of it fold into one a thread."""
    quarter = group % 4
    return (group - quarter) * (GROUP_COLUMNS // 2) + quarter + 4 * pair


@triton.jit
def top2_group_columns(group, lane, GROUP_COLUMNS: tl.constexpr):
    """The column (int32) of ``lane`` of group ``group`` of a `group_top2` matmul (`_thread_groups`):
    each run of 4 groups covers 4 · GROUP_COLUMNS columns, and group 4·r + q of it every 8th pair
    of them from column 2·q of the run on; lane 2·p + b is column b of pair p (`top2_group_pairs`,
    the same layout written for pairs)."""
    quarter = group % 4
    return (group - quarter) * GROUP_COLUMNS + 2 * quarter + 8 * (lane // 2) + lane % 2


def top2_group_column_table(groups: int, group_columns: int) -> torch.Tensor:
    """``[groups, group_columns]`` int64: the columns of each group of a `group_top2` matmul
    (`top2_group_columns` for the host)."""
    group = torch.arange(groups)[:, None]
    lane = torch.arange(group_columns)[None, :]
    quarter = group % 4
    return (group - quarter) * group_columns + 2 * quarter + 8 * (lane // 2) + lane % 2


# the interpreter has no libdevice: a bit-twiddling popcount there (tests), the hardware's on GPUs
POPC_IN_HARDWARE = tl.constexpr(not INTERPRETED)


@triton.jit
def _popcount(bits, HARDWARE: tl.constexpr):
    """Set bits of int32 ``bits`` (int32)."""
    if HARDWARE:
        return libdevice.popc(bits)
    x = bits.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


# the interpreter has no inline PTX: the appends' stores in Triton there (tests), in PTX on GPUs
STORE_APPENDS_IN_PTX = not INTERPRETED

# one element's append, its group's slots taken: where value >= floor, the slot first + the
# group's lanes below it (bits & below), the 8-byte key (column, value bits) stored below the
# capacity. Every element computes its slot and address and stores under a predicate, without a
# branch: a branch skipping that for the elements below the floor (nearly all of them) would make
# every warp holding one kept element diverge and reconverge, and with ~1 % kept at random that
# is a large share of the warps at large k.
_STORE_APPENDED_PTX = tl.constexpr("""
{
.reg .pred taken, kept;
.reg .b32 slot;
.reg .b64 address;
mov.u32 $0, 0;
setp.ge.f32 taken, $1, $2;
and.b32 slot, $3, $4;
popc.b32 slot, slot;
add.u32 slot, slot, $5;
setp.lt.and.u32 kept, slot, $6, taken;
mad.wide.u32 address, slot, 8, $7;
@kept st.global.b32 [address], $8;
@kept st.global.b32 [address+4], $1;
}
""")


@triton.jit
def _reserve_slots(grouped, row_offsets, floor_ptr, counts_ptr, GROUP_COLUMNS: tl.constexpr):
    """For ``grouped`` (`_thread_groups` of a tile's logits, [BLOCK_M, groups, GROUP_COLUMNS],
    -inf past the width; rows ``row_offsets`` int64, -1 for none): (each row's floor [BLOCK_M]
    float32, each group's bits of the lanes at or above it [BLOCK_M, groups] int32, the first of
    the slots reserved for them [BLOCK_M, groups] int32), one atomic on the row's count a row of
    the tile that has any."""
    lane = tl.arange(0, GROUP_COLUMNS)[None, None, :]
    floor = tl.load(floor_ptr + row_offsets, mask=row_offsets >= 0, other=float("inf"))
    bits = tl.sum(tl.where(grouped >= floor[:, None, None], 1 << lane, 0), axis=2)  # lane l's bit, in registers
    count = _popcount(bits, POPC_IN_HARDWARE)
    # one atomic a row of the tile (not one a row and group), the groups' first slots by an exclusive
    # prefix sum
    row_count = tl.sum(count, axis=1)
    row_first = tl.atomic_add(counts_ptr + row_offsets, row_count, mask=row_count > 0, sem="relaxed")
    first = row_first[:, None] + tl.cumsum(count, axis=1) - count
    return floor, bits, first


@triton.jit
def _store_appends(grouped, floor, bits, first, column_tile, row_offsets, keys_ptr, key_capacity,
                   BLOCK_N: tl.constexpr, GROUP_COLUMNS: tl.constexpr, IN_PTX: tl.constexpr):
    """Each element of ``grouped`` at or above its row's ``floor`` stored in its slot (`_reserve_slots`'
    ``first`` + a popcount of its group's ``bits`` below it) as one raw key (the float's bits above
    the column; ops/topk_from_appended.py `rank_appended` ranks them); slots past
    ``key_capacity`` dropped (the row's count passes it: the caller redoes the row)."""
    groups: tl.constexpr = grouped.shape[1]
    group = tl.arange(0, groups)[None, :, None]
    lane = tl.arange(0, GROUP_COLUMNS)[None, None, :]
    column = column_tile * BLOCK_N + top2_group_columns(group, lane, GROUP_COLUMNS)
    if IN_PTX:
        row_keys = (keys_ptr + row_offsets * key_capacity).to(tl.int64, bitcast=True)[:, None, None]
        tl.inline_asm_elementwise(_STORE_APPENDED_PTX, "=r,f,f,r,r,r,r,l,r",
                                  [grouped, floor[:, None, None], bits[:, :, None], (1 << lane) - 1,
                                   first[:, :, None], tl.full([1, 1, 1], key_capacity, tl.int32), row_keys, column],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        slot = first[:, :, None] + _popcount(bits[:, :, None] & ((1 << lane) - 1), POPC_IN_HARDWARE)
        raw_key = (grouped.to(tl.int32, bitcast=True).to(tl.int64) << 32) | column.to(tl.int64)
        place = (row_offsets.to(tl.int32) * key_capacity)[:, None, None] + slot
        tl.store(keys_ptr + place, raw_key, mask=(grouped >= floor[:, None, None]) & (slot < key_capacity))


@triton.jit
def _lm_head_group_maxima_kernel(hidden_desc, weight_desc, logits_desc, bias_ptr, tile_max2_ptr, tile_sum2_ptr,
                                 group_max_ptr, group_arg_ptr, group_second_ptr, num_rows, width, column_offset,
                                 hidden_size, log2e_over_t, floor_ptr, keys_ptr, counts_ptr, key_capacity,
                                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                                 GROUP_COLUMNS: tl.constexpr, SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                                 DOT_PRECISION: tl.constexpr, STORE_LOGITS: tl.constexpr = True,
                                 GROUP_TOP2: tl.constexpr = False, APPEND: tl.constexpr = False,
                                 APPEND_IN_PTX: tl.constexpr = False, SUMMARIES: tl.constexpr = True):
    row_tiles = tl.cdiv(num_rows, BLOCK_M)
    column_tiles = tl.cdiv(width, BLOCK_N)
    groups_per_tile: tl.constexpr = BLOCK_N // GROUP_COLUMNS
    num_groups = column_tiles * groups_per_tile
    # the epilogue's tile counter runs apart from the mainloop's: the flattened loop may
    # software-pipeline the next tile's loads under this tile's epilogue
    epilogue_tile = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), row_tiles * column_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        row_tile, column_tile = _tile_position(tile, row_tiles, column_tiles, GROUP_M)
        accumulator = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for step in range(0, hidden_size, BLOCK_K):
            a = hidden_desc.load([row_tile * BLOCK_M, step])
            b = weight_desc.load([column_offset + column_tile * BLOCK_N, step])
            accumulator = tl.dot(a, b.T, accumulator, input_precision=DOT_PRECISION)
        epilogue_tile += NUM_PROGRAMS
        row_tile, column_tile = _tile_position(epilogue_tile, row_tiles, column_tiles, GROUP_M)
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            accumulator += tl.load(bias_ptr + column_offset + columns, mask=columns < width,
                                   other=0.0).to(tl.float32)[None, :]
        if STORE_LOGITS:
            if SUBTILE:  # two stores of half the columns: half the shared-memory staging
                left, right = tl.split(tl.permute(tl.reshape(accumulator, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                logits_desc.store([row_tile * BLOCK_M, column_tile * BLOCK_N], left.to(logits_desc.dtype))
                logits_desc.store([row_tile * BLOCK_M, column_tile * BLOCK_N + BLOCK_N // 2],
                                  right.to(logits_desc.dtype))
            else:
                logits_desc.store([row_tile * BLOCK_M, column_tile * BLOCK_N], accumulator.to(logits_desc.dtype))
        if SUMMARIES:  # else the logits alone (the appended schedules' floors sample)
            z = tl.where(columns[None, :] < width, accumulator, float("-inf"))
            rows_ok = rows < num_rows
            row_offsets = rows.to(tl.int64)
            groups = column_tile * groups_per_tile + tl.arange(0, groups_per_tile)
            group_offsets = row_offsets[:, None] * num_groups + groups[None, :]
            if GROUP_TOP2:
                # lanes in pairs first: a pair's (larger, its lane, smaller) needs no -inf operand
                even, odd = tl.split(tl.reshape(_thread_groups(z, BLOCK_M, BLOCK_N, GROUP_COLUMNS),
                                                (BLOCK_M, groups_per_tile, GROUP_COLUMNS // 2, 2)))
                pair_lane = 2 * tl.arange(0, GROUP_COLUMNS // 2)[None, None, :] + (odd > even).to(tl.int32)
                group_max, group_arg, group_second = tl.reduce(
                    (tl.maximum(even, odd), pair_lane, tl.minimum(even, odd)), 2, _combine_top2)
                tl.store(group_arg_ptr + group_offsets, group_arg.to(tl.int8), mask=rows_ok[:, None])
                tl.store(group_second_ptr + group_offsets, group_second, mask=rows_ok[:, None])
                # rounding is monotone: the maximum of z · log2e / τ, from the groups already in registers
                # (no pass over z)
                tile_max2 = tl.max(group_max, axis=1) * log2e_over_t
            elif APPEND:
                grouped = _thread_groups(z, BLOCK_M, BLOCK_N, GROUP_COLUMNS)
                appending_rows = tl.where(rows_ok, row_offsets, -1)
                # before the statistics: their exp2 cover the atomics' round trip (the stores come after them)
                floor, bits, first = _reserve_slots(grouped, appending_rows, floor_ptr, counts_ptr, GROUP_COLUMNS)
                tile_max2 = tl.max(tl.max(grouped, axis=2), axis=1) * log2e_over_t
            else:
                group_max = tl.max(tl.reshape(z, (BLOCK_M, groups_per_tile, GROUP_COLUMNS)), axis=2)
                tile_max2 = tl.max(z * log2e_over_t, axis=1)
            safe_max2 = tl.where(tile_max2 == float("-inf"), 0.0, tile_max2)
            tile_sum2 = tl.sum(tl.exp2(tl.fma(z, log2e_over_t, -safe_max2[:, None])), axis=1)
            tl.store(tile_max2_ptr + row_offsets * column_tiles + column_tile, tile_max2, mask=rows_ok)
            tl.store(tile_sum2_ptr + row_offsets * column_tiles + column_tile, tile_sum2, mask=rows_ok)
            if APPEND:
                _store_appends(grouped, floor, bits, first, column_tile, appending_rows, keys_ptr, key_capacity,
                               BLOCK_N, GROUP_COLUMNS, APPEND_IN_PTX)
            else:
                tl.store(group_max_ptr + group_offsets, group_max, mask=rows_ok[:, None])


def _check_appends(appends: Appends, rows: int) -> None:
    """The kernel reads floors and counts at row offsets and keys at row · capacity: contiguous
    rows of the expected dtypes (a strided view of floors read other rows' values unnoticed)."""
    for name, tensor, dtype, shape in (("floors", appends.floors, torch.float32, (rows,)),
                                       ("counts", appends.counts, torch.int32, (rows,)),
                                       ("keys", appends.keys, torch.int64, (rows, appends.keys.shape[-1]))):
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"appends: expected contiguous {name} {list(shape)} {dtype}, got {tensor.dtype} "
                             f"{list(tensor.shape)} with strides {tensor.stride()}")


def epilogue_applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this kernel takes these inputs: 16-bit (float32 would need IEEE products, far
    slower than cuBLAS) with rows TMA can move (a hidden size that is a multiple of 8)."""
    return (hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
            and tma_rows(hidden) and tma_rows(weight))


def lm_head_logits_with_summaries(hidden: torch.Tensor, weight: torch.Tensor, bias, width: int,
                                  temperature: float, logits: torch.Tensor | None,
                                  config: GroupMaximaConfig | None = None, group_top2: bool = False) -> RowSummaries:
    """hidden ``[R, H]``, weight ``[≥ width, H]`` (bf16 / fp16, or float32 with IEEE products:
    the interpreter's tests), bias ``[≥ width]`` or None -> the float32 logits
    ``hidden @ weight[:width].T + bias`` written into ``logits [R, ≥ width]`` (rows starting at
    16-byte boundaries), and the rows' `RowSummaries`. ``logits=None``: the summaries
    only, no logits stored (the maxima schedule recomputes the few groups it needs).
    ``group_top2``: each group's maximum column and second largest too (`RowSummaries`)."""
    return EpilogueMatmul(hidden, weight, bias, width, temperature, logits, config, group_top2)(0, width)


class EpilogueMatmul:
    """The epilogue matmul of one block of rows against column slices of the weight (each at
    most ``max_width`` columns) into one logits buffer, its descriptors, summaries and grid made
    once, so that a call's host work is one launch. Arguments as
    `lm_head_logits_with_summaries`'s, ``weight`` and ``bias`` whole (the slices are offsets into
    them); ``appends``: append each element at or above its row's floor (`Appends`) instead of
    storing logits or group maxima; ``summaries=False``: the logits alone (a call returns None),
    no statistics computed or allocated."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias, max_width: int, temperature: float,
                 logits: torch.Tensor | None, config: GroupMaximaConfig | None = None, group_top2: bool = False,
                 appends: "Appends | None" = None, summaries: bool = True):
        config = config or default_config()
        if hidden.dtype == torch.float32 and not INTERPRETED:
            # the float32 tiles need ~320 KiB of shared memory, and IEEE products would trail cuBLAS far
            raise ValueError("hidden: the epilogue matmul takes bf16 / fp16 on a GPU (float32 only under "
                             "TRITON_INTERPRET=1, for the tests; the schedules send float32 to cuBLAS), got "
                             f"{hidden.dtype}")
        if appends is not None and (group_top2 or logits is not None):
            raise ValueError("appends: the matmul appends above floors with neither logits stored nor group_top2")
        if appends is not None:
            _check_appends(appends, hidden.shape[0])
        if not summaries and (logits is None or group_top2 or appends is not None):
            raise ValueError("summaries: a matmul without summaries stores logits, with neither group_top2 nor appends")
        if logits is not None and logits.dtype not in (torch.float32, hidden.dtype):
            raise ValueError(f"logits: expected a float32 buffer (rows starting at 16-byte boundaries) or one of the "
                             f"inputs' dtype {hidden.dtype} (rounded logits), got {logits.dtype}")
        if config.block_n % config.group_columns:
            raise ValueError(f"config: group_columns {config.group_columns} must divide block_n {config.block_n}")
        if group_top2 and (config.block_n % (4 * config.group_columns) or config.group_columns % 2):
            raise ValueError(f"config: group_top2 takes an even group_columns whose 4 groups divide block_n, got "
                             f"{config.group_columns} and {config.block_n}")
        self.hidden, self.bias, self.max_width, self.config = hidden, bias, max_width, config
        self.log2e_over_t = LOG2E / temperature
        self.store_logits = logits is not None
        self.group_top2 = group_top2
        self.appends = appends
        self.summaries = self._summaries(max_width) if summaries else None
        if hidden.shape[0] == 0:
            return
        user = "the teacher's epilogue matmul"
        self.hidden_desc = row_tile_descriptor(hidden, "hidden", [config.block_m, config.block_k], user)
        self.weight_desc = row_tile_descriptor(weight, "weight", [config.block_n, config.block_k], user)
        if logits is None:
            self.logits_desc = self.hidden_desc  # a stand-in: STORE_LOGITS=False compiles the stores away
        else:  # a narrower last slice stores junk past its width, inside the buffer
            store_columns = config.block_n // 2 if config.subtile else config.block_n
            self.logits_desc = row_tile_descriptor(logits[:, :max_width], "logits", [config.block_m, store_columns],
                                                   user)
        self.multiprocessors = (multiprocessor_count(hidden.device)
                                if hidden.device.type == "cuda" else 3)  # the interpreter: several tiles a program

    def _summaries(self, width: int) -> RowSummaries:
        column_tiles = -(-width // self.config.block_n)
        groups = column_tiles * (self.config.block_n // self.config.group_columns)
        rows = self.hidden.shape[0]
        # appending matmuls keep no group maxima (a stand-in of one column)
        tile_parts = [((rows, column_tiles), torch.float32)] * 2 + [((rows, 1 if self.appends else groups),
                                                                     torch.float32)]
        top2_parts = [((rows, groups), torch.int8), ((rows, groups), torch.float32)] if self.group_top2 else []
        tile_max2, tile_sum2, group_max, *top2 = empty_parts(self.hidden.device, *tile_parts, *top2_parts)
        return RowSummaries(tile_max2, tile_sum2, group_max, self.config.group_columns, *(top2 or (None, None)))

    def __call__(self, column_start: int, width: int) -> RowSummaries | None:
        """Columns ``column_start … column_start + width`` (width ≤ max_width) -> their logits
        in the buffer's first ``width`` columns and their `RowSummaries` (the same tensors from
        one full-width call to the next: read them before the next call; None without
        summaries)."""
        config = self.config
        summaries = self.summaries
        if summaries is not None and width != self.max_width:
            summaries = self._summaries(width)
        num_rows, hidden_size = self.hidden.shape
        if num_rows == 0:
            return summaries
        tiles = -(-num_rows // config.block_m) * -(-width // config.block_n)
        programs = min(tiles, self.multiprocessors)
        # stand-ins fill the operands a variant does not read
        stand_in = summaries.tile_max2 if summaries is not None else self.hidden
        _lm_head_group_maxima_kernel[(programs,)](
            self.hidden_desc, self.weight_desc, self.logits_desc,
            self.bias if self.bias is not None else stand_in, stand_in,
            summaries.tile_sum2 if summaries is not None else stand_in,
            summaries.group_max if summaries is not None else stand_in,
            summaries.group_arg if self.group_top2 else stand_in,
            summaries.group_second if self.group_top2 else stand_in,
            num_rows, width, column_start, hidden_size, self.log2e_over_t,
            *(self.appends.operands() if self.appends else (stand_in, stand_in, stand_in, 0)),
            HAS_BIAS=self.bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, NUM_PROGRAMS=programs, GROUP_COLUMNS=config.group_columns,
            SUBTILE=config.subtile, FLATTEN=config.flatten, STORE_LOGITS=self.store_logits,
            GROUP_TOP2=self.group_top2, APPEND=self.appends is not None,
            APPEND_IN_PTX=STORE_APPENDS_IN_PTX, SUMMARIES=summaries is not None,
            # float32 inputs get float32 products (tf32 would move logits by ~1e-3)
            DOT_PRECISION="ieee" if self.hidden.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages)
        return summaries
