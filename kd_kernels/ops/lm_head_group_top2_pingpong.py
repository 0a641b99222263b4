"""The Gluon ping-pong kernel behind ops/lm_head_group_top2_hopper.py (sm_90 only; see there).

Partitions: the default one (4 warps, one thread issuing) walks the program's tiles in order and
loads each hidden step of the hidden and weight tiles into a ring of STAGES buffers by TMA;
consumer c (a warpgroup of its own) takes tiles c, c + 2, ... of the sequence: waits for each
step's buffers, issues its warpgroup MMA with one in flight, gives the previous step's buffers
back, then runs the epilogue while the other consumer's mainloop runs.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .lm_head_group_maxima import RowSummaries, _combine_top2, _tile_position


@gluon.jit
def _load_partition(hidden_desc, weight_desc, a_bufs, b_bufs, ready, empty, num_rows, width, column_offset,
                    hidden_size, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    row_tiles = gl.cdiv(num_rows, BLOCK_M)
    column_tiles = gl.cdiv(width, BLOCK_N)
    count = 0
    for tile in range(gl.program_id(0), row_tiles * column_tiles, NUM_PROGRAMS):
        row_tile, column_tile = _tile_position(tile, row_tiles, column_tiles, GROUP_M)
        for step in range(0, hidden_size, BLOCK_K):
            stage = count % STAGES
            # a fresh barrier passes a wait on parity 1: the ring starts empty
            mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), hidden_desc.block_type.nbytes + weight_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(hidden_desc, [row_tile * BLOCK_M, step], ready.index(stage),
                                            a_bufs.index(stage))
            tma.async_copy_global_to_shared(weight_desc, [column_offset + column_tile * BLOCK_N, step],
                                            ready.index(stage), b_bufs.index(stage))
            count += 1


@gluon.jit
def _top2_epilogue(accumulator, row_tile, column_tile, bias_ptr, tile_max2_ptr, tile_sum2_ptr, group_max_ptr,
                   group_arg_ptr, group_second_ptr, num_rows, width, column_offset, log2e_over_t,
                   HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   GROUP_COLUMNS: gl.constexpr, layout: gl.constexpr):
    """The Triton epilogue matmul's ``GROUP_TOP2`` epilogue of one tile: groups interleaved so
    that a thread of the accumulator holds a whole group (group 4·h + q: columns
    4·GROUP_COLUMNS·h + 8·j + 2·q + b), reduced in registers, lanes in pairs first."""
    columns = column_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    if HAS_BIAS:
        accumulator += gl.load(bias_ptr + column_offset + columns, mask=columns < width,
                               other=0.0).to(gl.float32)[None, :]
    z = gl.where(columns[None, :] < width, accumulator, float("-inf"))
    halves: gl.constexpr = BLOCK_N // (4 * GROUP_COLUMNS)
    groups_per_tile: gl.constexpr = BLOCK_N // GROUP_COLUMNS
    z5 = gl.reshape(z, (BLOCK_M, halves, GROUP_COLUMNS // 2, 4, 2))
    grouped = gl.reshape(gl.permute(z5, (0, 1, 3, 2, 4)), (BLOCK_M, groups_per_tile, GROUP_COLUMNS))
    even, odd = gl.split(gl.reshape(grouped, (BLOCK_M, groups_per_tile, GROUP_COLUMNS // 2, 2)))
    pair_layout: gl.constexpr = even.type.layout
    pair = gl.arange(0, GROUP_COLUMNS // 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, pair_layout)))
    pair_lane = 2 * gl.expand_dims(gl.expand_dims(pair, 0), 0) + (odd > even).to(gl.int32)
    group_max, group_arg, group_second = gl.reduce((gl.maximum(even, odd), pair_lane, gl.minimum(even, odd)), 2,
                                                   _combine_top2)
    group_layout: gl.constexpr = group_max.type.layout
    rows = row_tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, group_layout))
    groups = column_tile * groups_per_tile + gl.arange(0, groups_per_tile, layout=gl.SliceLayout(0, group_layout))
    column_tiles = gl.cdiv(width, BLOCK_N)
    row_offsets = rows.to(gl.int64)
    group_offsets = row_offsets[:, None] * (column_tiles * groups_per_tile) + groups[None, :]
    rows_ok = rows < num_rows
    gl.store(group_max_ptr + group_offsets, group_max, mask=rows_ok[:, None])
    gl.store(group_arg_ptr + group_offsets, group_arg.to(gl.int8), mask=rows_ok[:, None])
    gl.store(group_second_ptr + group_offsets, group_second, mask=rows_ok[:, None])
    # rounding is monotone: the maximum of z · log2e / τ is the largest group maximum's
    tile_max2 = gl.max(group_max, axis=1) * log2e_over_t
    safe_max2 = gl.where(tile_max2 == float("-inf"), 0.0, tile_max2)
    safe_max2 = gl.convert_layout(safe_max2, gl.SliceLayout(1, layout))
    tile_sum2 = gl.sum(gl.exp2(gl.fma(z, log2e_over_t, -safe_max2[:, None])), axis=1)
    tile_sum2 = gl.convert_layout(tile_sum2, gl.SliceLayout(1, group_layout))
    gl.store(tile_max2_ptr + row_offsets * column_tiles + column_tile, tile_max2, mask=rows_ok)
    gl.store(tile_sum2_ptr + row_offsets * column_tiles + column_tile, tile_sum2, mask=rows_ok)


@gluon.jit
def _mma_partition(CONSUMER: gl.constexpr, a_bufs, b_bufs, ready, empty, order, bias_ptr, tile_max2_ptr,
                   tile_sum2_ptr, group_max_ptr, group_arg_ptr, group_second_ptr, num_rows, width, column_offset,
                   hidden_size, log2e_over_t, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                   NUM_PROGRAMS: gl.constexpr, GROUP_COLUMNS: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    row_tiles = gl.cdiv(num_rows, BLOCK_M)
    column_tiles = gl.cdiv(width, BLOCK_N)
    steps = gl.cdiv(hidden_size, BLOCK_K)
    local = 0
    for tile in range(gl.program_id(0) + CONSUMER * NUM_PROGRAMS, row_tiles * column_tiles, 2 * NUM_PROGRAMS):
        count = (2 * local + CONSUMER) * steps
        # the other consumer's mainloop before this one has issued all its steps: otherwise a
        # consumer could wait on a ring phase two ahead, whose parity a stale phase also shows
        mbarrier.wait(order.index(1 - CONSUMER), (local - 1 + CONSUMER) & 1, pred=(CONSUMER == 1) | (local > 0))
        accumulator = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        previous = 0
        for step in range(steps):
            stage = count % STAGES
            mbarrier.wait(ready.index(stage), (count // STAGES) & 1)
            accumulator = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), accumulator,
                                        is_async=True)
            accumulator = warpgroup_mma_wait(num_outstanding=1, deps=(accumulator, ))
            # the step before has retired: its buffers go back to the producer
            mbarrier.arrive(empty.index(previous), count=1, pred=step > 0)
            previous = stage
            count += 1
        mbarrier.arrive(order.index(CONSUMER), count=1)
        accumulator = warpgroup_mma_wait(num_outstanding=0, deps=(accumulator, ))
        mbarrier.arrive(empty.index(previous), count=1)
        row_tile, column_tile = _tile_position(tile, row_tiles, column_tiles, GROUP_M)
        _top2_epilogue(accumulator, row_tile, column_tile, bias_ptr, tile_max2_ptr, tile_sum2_ptr, group_max_ptr,
                       group_arg_ptr, group_second_ptr, num_rows, width, column_offset, log2e_over_t, HAS_BIAS,
                       BLOCK_M, BLOCK_N, GROUP_COLUMNS, layout)
        local += 1


@gluon.jit
def _lm_head_group_top2_pingpong_kernel(hidden_desc, weight_desc, bias_ptr, tile_max2_ptr, tile_sum2_ptr,
                                        group_max_ptr, group_arg_ptr, group_second_ptr, num_rows, width,
                                        column_offset, hidden_size, log2e_over_t, HAS_BIAS: gl.constexpr,
                                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                        GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                                        GROUP_COLUMNS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr):
    dtype: gl.constexpr = hidden_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], hidden_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], weight_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(order.index(0), count=1)
    mbarrier.init(order.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # the producer is the default partition, the consumers are warpgroups of their own
    gl.warp_specialize([
        (_load_partition, (hidden_desc, weight_desc, a_bufs, b_bufs, ready, empty, num_rows, width, column_offset,
                           hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS)),
        (_mma_partition, (0, a_bufs, b_bufs, ready, empty, order, bias_ptr, tile_max2_ptr, tile_sum2_ptr,
                          group_max_ptr, group_arg_ptr, group_second_ptr, num_rows, width, column_offset,
                          hidden_size, log2e_over_t, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                          NUM_PROGRAMS, GROUP_COLUMNS)),
        (_mma_partition, (1, a_bufs, b_bufs, ready, empty, order, bias_ptr, tile_max2_ptr, tile_sum2_ptr,
                          group_max_ptr, group_arg_ptr, group_second_ptr, num_rows, width, column_offset,
                          hidden_size, log2e_over_t, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                          NUM_PROGRAMS, GROUP_COLUMNS)),
    ], [4, 4], [CONSUMER_REGISTERS, CONSUMER_REGISTERS])


def launch_group_top2_pingpong(hidden: torch.Tensor, weight: torch.Tensor, bias, summaries: RowSummaries, width: int,
                               column_start: int, log2e_over_t: float, multiprocessors: int, block_shape=None,
                               stages: int | None = None, group_m: int | None = None) -> None:
    """Fills ``summaries`` (allocated for 128-column tiles by the caller) from ``hidden [R, H]``
    and ``weight`` rows ``column_start …`` (bf16 / fp16). ``block_shape``, ``stages`` and
    ``group_m`` override the module's constants (the probe's sweeps)."""
    from . import lm_head_group_top2_hopper as hopper

    block_m, block_n, block_k = block_shape or (hopper.BLOCK_M, hopper.BLOCK_N, hopper.BLOCK_K)
    element = gl.bfloat16 if hidden.dtype == torch.bfloat16 else gl.float16
    hidden_desc = TensorDescriptor.from_tensor(hidden, [block_m, block_k],
                                               gl.NVMMASharedLayout.get_default_for([block_m, block_k], element))
    weight_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k],
                                               gl.NVMMASharedLayout.get_default_for([block_n, block_k], element))
    rows, hidden_size = hidden.shape
    tiles = -(-rows // block_m) * -(-width // block_n)
    programs = min(tiles, multiprocessors)
    _lm_head_group_top2_pingpong_kernel[(programs,)](
        hidden_desc, weight_desc, bias if bias is not None else summaries.tile_max2, summaries.tile_max2,
        summaries.tile_sum2, summaries.group_max, summaries.group_arg, summaries.group_second, rows, width,
        column_start, hidden_size, log2e_over_t, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=group_m or hopper.GROUP_M, STAGES=stages or hopper.STAGES, NUM_PROGRAMS=programs,
        GROUP_COLUMNS=summaries.group_columns, CONSUMER_REGISTERS=hopper.CONSUMER_REGISTERS, num_warps=4)
