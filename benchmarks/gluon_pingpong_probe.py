"""Can a ping-pong Hopper matmul hide the teacher's top-2 epilogue? (issue #4, k = 64; NOTES e38)

The teacher's epilogue matmul (kd_kernels/ops/lm_head_group_maxima.py) is cooperative: 8 warps
share one 128 × 256 accumulator, so a tile's epilogue (the group top-2, Σ exp) runs while the
tensor cores idle: ~1.038× cuBLAS against ~1.016× for a bf16 store (NOTES e28). A ping-pong
schedule gives each of two 4-warp consumers its own tile (64 × 256 here) and a 1-warp producer
feeds both from one TMA ring in tile order, so one consumer's epilogue runs under the other's
mainloop. The cost: 64-row tiles read the weight twice as often from L2 (~200 GB a call against
~120 GB at 128 × 256).

Times at 8192 × 4096 × 151,936 bf16 (one launch over all rows), in blocks, medians of fresh
inputs (LLM-like rows): cuBLAS bf16, the Triton epilogue matmul (statistics only; group top-2),
and the Gluon ping-pong matmul with a bf16 TMA store and with the group top-2 epilogue. Checks
the ping-pong outputs against cuBLAS (store) and against the Triton kernel (top-2 summaries).

usage: python benchmarks/gluon_pingpong_probe.py [--compile-only] [--repeats 10]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@gluon.jit
def _tile_position(tile, row_tiles, column_tiles, GROUP_M: gl.constexpr):
    # the Triton kernel's order (GROUP_M row tiles share each column tile in turn)
    in_group = GROUP_M * column_tiles
    first_row_tile = (tile // in_group) * GROUP_M
    group_rows = min(row_tiles - first_row_tile, GROUP_M)
    return first_row_tile + tile % group_rows, (tile % in_group) // group_rows


@gluon.jit
def _combine_top2(max_a, arg_a, second_a, max_b, arg_b, second_b):
    return (gl.maximum(max_a, max_b), gl.where(max_b > max_a, arg_b, arg_a),
            gl.maximum(gl.minimum(max_a, max_b), gl.maximum(second_a, second_b)))


@gluon.jit
def _load_partition(hidden_desc, weight_desc, a_bufs, b_bufs, ready, empty, num_rows, width, hidden_size,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
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
            tma.async_copy_global_to_shared(weight_desc, [column_tile * BLOCK_N, step], ready.index(stage),
                                            b_bufs.index(stage))
            count += 1


@gluon.jit
def _top2_epilogue(accumulator, row_tile, column_tile, num_rows, width, log2e_over_t, tile_max2_ptr, tile_sum2_ptr,
                   group_max_ptr, group_arg_ptr, group_second_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   GROUP_COLUMNS: gl.constexpr, layout: gl.constexpr):
    columns = column_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
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
    num_groups = gl.cdiv(width, BLOCK_N) * groups_per_tile
    row_offsets = rows.to(gl.int64)
    group_offsets = row_offsets[:, None] * num_groups + groups[None, :]
    rows_ok = rows < num_rows
    gl.store(group_max_ptr + group_offsets, group_max, mask=rows_ok[:, None])
    gl.store(group_arg_ptr + group_offsets, group_arg.to(gl.int8), mask=rows_ok[:, None])
    gl.store(group_second_ptr + group_offsets, group_second, mask=rows_ok[:, None])
    tile_max2 = gl.max(group_max, axis=1) * log2e_over_t
    safe_max2 = gl.where(tile_max2 == float("-inf"), 0.0, tile_max2)
    safe_max2 = gl.convert_layout(safe_max2, gl.SliceLayout(1, layout))
    tile_sum2 = gl.sum(gl.exp2(gl.fma(z, log2e_over_t, -safe_max2[:, None])), axis=1)
    tile_sum2 = gl.convert_layout(tile_sum2, gl.SliceLayout(1, group_layout))
    column_tiles = gl.cdiv(width, BLOCK_N)
    gl.store(tile_max2_ptr + row_offsets * column_tiles + column_tile, tile_max2, mask=rows_ok)
    gl.store(tile_sum2_ptr + row_offsets * column_tiles + column_tile, tile_sum2, mask=rows_ok)


@gluon.jit
def _mma_partition(CONSUMER: gl.constexpr, a_bufs, b_bufs, ready, empty, order, out_smem, out_desc, tile_max2_ptr,
                   tile_sum2_ptr, group_max_ptr, group_arg_ptr, group_second_ptr, num_rows, width, hidden_size,
                   log2e_over_t, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                   GROUP_COLUMNS: gl.constexpr, EPILOGUE: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    row_tiles = gl.cdiv(num_rows, BLOCK_M)
    column_tiles = gl.cdiv(width, BLOCK_N)
    steps = gl.cdiv(hidden_size, BLOCK_K)
    local = 0
    # this consumer takes every other tile of the program's sequence; the producer loads them all in
    # order, so the two mainloops alternate and one's epilogue runs under the other's mainloop
    for tile in range(gl.program_id(0) + CONSUMER * NUM_PROGRAMS, row_tiles * column_tiles, 2 * NUM_PROGRAMS):
        count = (2 * local + CONSUMER) * steps
        # the other consumer's mainloop before this one has issued all its steps: without this a
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
            # the step before has retired: its stage goes back to the producer
            mbarrier.arrive(empty.index(previous), count=1, pred=step > 0)
            previous = stage
            count += 1
        mbarrier.arrive(order.index(CONSUMER), count=1)
        accumulator = warpgroup_mma_wait(num_outstanding=0, deps=(accumulator, ))
        mbarrier.arrive(empty.index(previous), count=1)
        row_tile, column_tile = _tile_position(tile, row_tiles, column_tiles, GROUP_M)
        if EPILOGUE == 0:
            tma.store_wait(pendings=0)  # the last tile's store has left this consumer's staging buffer
            out_smem.store(accumulator.to(out_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [row_tile * BLOCK_M, column_tile * BLOCK_N], out_smem)
        else:
            _top2_epilogue(accumulator, row_tile, column_tile, num_rows, width, log2e_over_t, tile_max2_ptr,
                           tile_sum2_ptr, group_max_ptr, group_arg_ptr, group_second_ptr, BLOCK_M, BLOCK_N,
                           GROUP_COLUMNS, layout)
        local += 1
    if EPILOGUE == 0:
        tma.store_wait(pendings=0)


@gluon.jit
def _pingpong_kernel(hidden_desc, weight_desc, out_desc, tile_max2_ptr, tile_sum2_ptr, group_max_ptr, group_arg_ptr,
                     group_second_ptr, num_rows, width, hidden_size, log2e_over_t, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                     NUM_PROGRAMS: gl.constexpr, GROUP_COLUMNS: gl.constexpr, EPILOGUE: gl.constexpr,
                     CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
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
    if EPILOGUE == 0:
        out_smem0 = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_M, BLOCK_N], out_desc.layout)
        out_smem1 = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_M, BLOCK_N], out_desc.layout)
    else:  # no staging: a stand-in the partitions never touch
        out_smem0 = empty
        out_smem1 = empty
    # the producer is the default partition (4 warps, one thread issuing the copies), the two
    # consumers are whole warpgroups of their own (the layout a crash-free Hopper Gluon kernel has)
    gl.warp_specialize([
        (_load_partition, (hidden_desc, weight_desc, a_bufs, b_bufs, ready, empty, num_rows, width, hidden_size,
                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS)),
        (_mma_partition, (0, a_bufs, b_bufs, ready, empty, order, out_smem0, out_desc, tile_max2_ptr, tile_sum2_ptr,
                          group_max_ptr, group_arg_ptr, group_second_ptr, num_rows, width, hidden_size, log2e_over_t,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS, GROUP_COLUMNS, EPILOGUE)),
        (_mma_partition, (1, a_bufs, b_bufs, ready, empty, order, out_smem1, out_desc, tile_max2_ptr, tile_sum2_ptr,
                          group_max_ptr, group_arg_ptr, group_second_ptr, num_rows, width, hidden_size, log2e_over_t,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS, GROUP_COLUMNS, EPILOGUE)),
    ], [4, 4], [CONSUMER_REGISTERS, CONSUMER_REGISTERS])


PROBE_DEFAULTS = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=16, STAGES=4, GROUP_COLUMNS=32,
                      CONSUMER_REGISTERS=232, PRODUCER_REGISTERS=40)


def pingpong_matmul(hidden, weight, epilogue: str, temperature: float = 1.0, stages: int = 4, group_m: int = 16,
                    block_m: int = 64, block_n: int = 256, block_k: int = 64, registers: tuple = (232, 40)):
    """hidden [R, H] bf16, weight [V, H] bf16 -> ("store") logits [R, V] bf16, or ("top2") the
    group top-2 summaries (tile_max2, tile_sum2, group_max, group_arg, group_second) of the
    Triton epilogue matmul's `group_top2` form (interleaved groups of 32 columns)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    config = dict(PROBE_DEFAULTS, STAGES=stages, GROUP_M=group_m, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  CONSUMER_REGISTERS=registers[0], PRODUCER_REGISTERS=registers[1])
    rows, hidden_size = hidden.shape
    width = weight.shape[0]
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    hidden_desc = TensorDescriptor.from_tensor(hidden, [bm, bk], a_layout)
    weight_desc = TensorDescriptor.from_tensor(weight, [bn, bk], b_layout)
    column_tiles = triton.cdiv(width, bn)
    groups = column_tiles * bn // config["GROUP_COLUMNS"]
    device = hidden.device
    if epilogue == "store":
        logits = torch.empty(rows, width, device=device, dtype=torch.bfloat16)
        out_desc = TensorDescriptor.from_tensor(logits, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn],
                                                                                                        gl.bfloat16))
        stand_in = torch.empty(1, device=device, dtype=torch.float32)
        summaries = (stand_in,) * 5
    else:
        logits = None
        out_desc = hidden_desc
        summaries = (torch.empty(rows, column_tiles, device=device, dtype=torch.float32),
                     torch.empty(rows, column_tiles, device=device, dtype=torch.float32),
                     torch.empty(rows, groups, device=device, dtype=torch.float32),
                     torch.empty(rows, groups, device=device, dtype=torch.int8),
                     torch.empty(rows, groups, device=device, dtype=torch.float32))
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    _pingpong_kernel[(programs,)](hidden_desc, weight_desc, out_desc, *summaries, rows, width, hidden_size,
                                 1.4426950408889634 / temperature, NUM_PROGRAMS=programs,
                                 EPILOGUE=0 if epilogue == "store" else 1, num_warps=4, **config)
    return logits if epilogue == "store" else summaries


def compile_for_sm90(epilogue: int, stages: int = 4, block_m: int = 64, block_n: int = 256,
                     registers: tuple = (232, 40)) -> dict:
    """The kernel compiled for sm_90 on this machine (no GPU): registers, spills, shared memory."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, bk = block_m, block_n, 64
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    c_layout = gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16)
    signature = {"hidden_desc": f"tensordesc<bf16[{bm},{bk}],{a_layout!r}>",
                 "weight_desc": f"tensordesc<bf16[{bn},{bk}],{b_layout!r}>",
                 "out_desc": (f"tensordesc<bf16[{bm},{bn}],{c_layout!r}>" if epilogue == 0
                              else f"tensordesc<bf16[{bm},{bk}],{a_layout!r}>"),
                 "tile_max2_ptr": "*fp32", "tile_sum2_ptr": "*fp32", "group_max_ptr": "*fp32",
                 "group_arg_ptr": "*i8", "group_second_ptr": "*fp32", "num_rows": "i32", "width": "i32",
                 "hidden_size": "i32", "log2e_over_t": "fp32"}
    constants = dict(PROBE_DEFAULTS, STAGES=stages, BLOCK_M=bm, BLOCK_N=bn, NUM_PROGRAMS=132, EPILOGUE=epilogue,
                     CONSUMER_REGISTERS=registers[0], PRODUCER_REGISTERS=registers[1])
    signature.update({key: "constexpr" for key in constants})
    source = GluonASTSource(_pingpong_kernel, signature, constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    return dict(registers=int(found.group(1)), stack=int(found.group(2)), shared=compiled.metadata.shared,
                setmaxnreg=sorted(set(re.findall(r"USETMAXREG[^;]*", sass))), instructions=sass.count("\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="sm_90 compile on this machine, no GPU")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep", action="store_true",
                        help="top-2 only: tile shapes x GROUP_M x stages, then the best two timed in turn")
    args = parser.parse_args()
    if args.compile_only:
        for (block_m, block_n), stages in (((64, 256), 4), ((128, 128), 4), ((128, 128), 5)):
            for epilogue, name in ((0, "store"), (1, "top2")):
                print(block_m, block_n, stages, name, compile_for_sm90(epilogue, stages, block_m, block_n))
        return
    run_on_gpu(args)


def run_on_gpu(args) -> None:
    import itertools

    from harness import teacher_s1, time_ms

    from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul

    torch.manual_seed(0)
    hidden, weight = teacher_s1()
    rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    flops = 2 * rows * hidden_size * vocab
    # two sets of inputs in turn (fresh values, the same LLM-like scale)
    inputs = itertools.cycle([(hidden,), (hidden[torch.randperm(rows, device="cuda")].contiguous(),)])
    # correctness first: the store against cuBLAS, the top-2 summaries against the Triton kernel
    reference = hidden @ weight.T
    logits = pingpong_matmul(hidden, weight, "store")
    store_error = (logits.float() - reference.float()).abs().max().item()
    triton_summaries = EpilogueMatmul(hidden, weight, None, vocab, 1.0, None, group_top2=True)(0, vocab)
    ours = pingpong_matmul(hidden, weight, "top2")
    theirs = (triton_summaries.tile_max2, triton_summaries.tile_sum2, triton_summaries.group_max,
              triton_summaries.group_arg, triton_summaries.group_second)
    names = ("tile_max2", "tile_sum2", "group_max", "group_arg", "group_second")
    for name, a, b in zip(names, ours, theirs):
        differ = (a.float() != b.float()).float().mean().item()
        print(f"check {name}: fraction differing from the Triton kernel {differ:.2e}, "
              f"max |diff| {(a.float() - b.float()).abs().max().item():.3e}")
    print(f"check store: max |ping-pong - cuBLAS| {store_error:.3e}")
    narrow = pingpong_matmul(hidden, weight, "top2", block_m=128, block_n=128, group_m=8)
    groups = triton_summaries.group_max.shape[1] - 4  # 128-column tiles: one group run fewer past the width
    for name, a, b in zip(names[2:], narrow[2:], theirs[2:]):
        differ = (a[:, :groups].float() != b[:, :groups].float()).float().mean().item()
        print(f"check 128 x 128 {name}: fraction differing from the Triton kernel {differ:.2e}")
    del reference, logits
    if args.sweep:
        return sweep(args, hidden, weight, inputs, flops)
    cases = {
        "cuBLAS bf16": lambda h: h @ weight.T,
        "triton statistics only": lambda h: EpilogueMatmul(h, weight, None, vocab, 1.0, None)(0, vocab),
        "triton group top-2": lambda h: EpilogueMatmul(h, weight, None, vocab, 1.0, None,
                                                      group_top2=True)(0, vocab),
    }
    cases["ping-pong store, 4 stages"] = lambda h: pingpong_matmul(h, weight, "store")
    for stages in (4, 5):
        cases[f"ping-pong top-2, {stages} stages"] = (lambda h, s=stages: pingpong_matmul(h, weight, "top2",
                                                                                         stages=s))
    cases["ping-pong top-2, 5 stages, GROUP_M 8"] = lambda h: pingpong_matmul(h, weight, "top2", stages=5, group_m=8)
    cases["ping-pong top-2, 5 stages, GROUP_M 32"] = lambda h: pingpong_matmul(h, weight, "top2", stages=5,
                                                                               group_m=32)
    for stages in (4, 5):
        for epilogue in ("store", "top2"):
            cases[f"ping-pong 128 x 128 {epilogue}, {stages} stages"] = (
                lambda h, s=stages, e=epilogue: pingpong_matmul(h, weight, e, stages=s, block_m=128, block_n=128,
                                                                group_m=8))
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = time_ms(fn, lambda: next(inputs), repeats=args.repeats)[0]
        except Exception as error:  # a variant that does not compile or launch is a finding, not a stop
            print(f"{name}: {type(error).__name__}: {str(error)[:300]}")
    floor = results["cuBLAS bf16"]
    print(f"\n{rows} x {hidden_size} x {vocab} bf16, in blocks, median of {args.repeats}")
    print("| case | ms | TFLOP/s | x cuBLAS |\n| --- | --- | --- | --- |")
    for name, ms in results.items():
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {ms / floor:.3f} |")



SWEEP = [  # (block_m, block_n, block_k, stages, group_m): the ping-pong top-2 forms timed by --sweep
    (64, 256, 64, 5, 32), (64, 256, 64, 5, 64), (64, 256, 64, 5, 128),
    (128, 128, 64, 5, 16), (128, 128, 64, 5, 32), (128, 128, 64, 6, 16), (128, 128, 64, 6, 32),
    (128, 128, 64, 6, 64), (128, 128, 128, 3, 16), (128, 128, 128, 3, 32),
]


def sweep(args, hidden, weight, inputs, flops) -> None:
    from harness import time_interleaved_ms, time_ms

    from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul

    vocab = weight.shape[0]
    cases = {"cuBLAS bf16": lambda h: h @ weight.T,
             "triton group top-2": lambda h: EpilogueMatmul(h, weight, None, vocab, 1.0, None,
                                                           group_top2=True)(0, vocab)}
    for bm, bn, bk, stages, group_m in SWEEP:
        cases[f"ping-pong top-2 {bm} x {bn} x {bk}, {stages} stages, GROUP_M {group_m}"] = (
            lambda h, c=(bm, bn, bk, stages, group_m): pingpong_matmul(h, weight, "top2", block_m=c[0], block_n=c[1],
                                                                       block_k=c[2], stages=c[3], group_m=c[4]))
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = time_ms(fn, lambda: next(inputs), repeats=args.repeats)[0]
        except Exception as error:
            print(f"{name}: {type(error).__name__}: {str(error)[:300]}")
    floor = results["cuBLAS bf16"]
    print("| case (in blocks) | ms | TFLOP/s | x cuBLAS |\n| --- | --- | --- | --- |")
    for name, ms in results.items():
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {ms / floor:.3f} |")
    pingpong = sorted((ms, name) for name, ms in results.items() if name.startswith("ping-pong"))[:2]
    chosen = ["cuBLAS bf16", "triton group top-2"] + [name for _, name in pingpong]
    hidden_b = next(inputs)[0]
    in_turn, ratios = time_interleaved_ms({name: (cases[name], lambda: (hidden_b,)) for name in chosen})
    print("| case (in turn) | ms | median ratio to cuBLAS |\n| --- | --- | --- |")
    for name in chosen:
        print(f"| {name} | {in_turn[name][0]:.3f} | {ratios[name]:.3f} |")


if __name__ == "__main__":
    main()
