"""The Hopper ping-pong group top-2 matmul (kd_kernels/ops/lm_head_group_top2_pingpong.py) against
cuBLAS and the Triton epilogue matmul it replaces on sm_90 (issue #4, k = 64; NOTES e38).

Checks its summaries bit for bit against the Triton kernel's groups (and tile statistics where
the tiles are 256 columns wide), then times, at 8192 × 4096 × 151,936 bf16 (one launch over all
rows; LLM-like rows), in blocks: cuBLAS bf16, the Triton statistics-only and group top-2
matmuls, and the ping-pong kernel over tile shapes, hidden steps, stages and GROUP_M; the best
two again timed in turn beside cuBLAS and the Triton top-2.

The first run (`5390e8c`, results/gluon_pingpong_probe_5390e8c.log) also timed the ping-pong
kernel storing bf16 logits instead (1.060× cuBLAS at 64 × 256 tiles, the top-2 1.067×): the
epilogue hides, the mainloop's extra L2 traffic is the cost; that form is not kept.

usage: python benchmarks/gluon_pingpong_probe.py [--compile-only] [--repeats 10]
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kd_kernels.ops import lm_head_group_top2_hopper as hopper  # noqa: E402
from kd_kernels.ops.launch import multiprocessor_count  # noqa: E402
from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul, RowSummaries  # noqa: E402

SWEEP = [  # (block_m, block_n, block_k, stages, group_m)
    (128, 128, 64, 5, 16), (128, 128, 64, 5, 8), (128, 128, 64, 4, 16), (128, 128, 64, 5, 12),
    (128, 128, 64, 6, 16), (64, 256, 64, 5, 32), (128, 128, 128, 3, 16),
]


def pingpong_summaries(hidden, weight, block_shape, stages, group_m) -> RowSummaries:
    """The kernel's summaries with its constants overridden (tiles of ``block_shape[1]`` columns)."""
    from kd_kernels.ops.lm_head_group_top2_pingpong import launch_group_top2_pingpong

    width = weight.shape[0]
    summaries = hopper.empty_top2_summaries(hidden.shape[0], width, block_shape[1], hidden.device)
    launch_group_top2_pingpong(hidden, weight, None, summaries, width, 0, 1.4426950408889634,
                               multiprocessor_count(hidden.device), block_shape=block_shape, stages=stages,
                               group_m=group_m)
    return summaries


def compile_for_sm90() -> dict:
    """The kernel at the module's constants compiled for sm_90 on this machine (no GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from kd_kernels.ops.lm_head_group_top2_pingpong import _lm_head_group_top2_pingpong_kernel

    bm, bn, bk = hopper.BLOCK_M, hopper.BLOCK_N, hopper.BLOCK_K
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    signature = {"hidden_desc": f"tensordesc<bf16[{bm},{bk}],{a_layout!r}>",
                 "weight_desc": f"tensordesc<bf16[{bn},{bk}],{b_layout!r}>", "bias_ptr": "*fp32",
                 "tile_max2_ptr": "*fp32", "tile_sum2_ptr": "*fp32", "group_max_ptr": "*fp32",
                 "group_arg_ptr": "*i8", "group_second_ptr": "*fp32", "num_rows": "i32", "width": "i32",
                 "column_offset": "i32", "hidden_size": "i32", "log2e_over_t": "fp32"}
    constants = dict(HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=hopper.GROUP_M,
                     STAGES=hopper.STAGES, NUM_PROGRAMS=132, GROUP_COLUMNS=hopper.GROUP_COLUMNS,
                     CONSUMER_REGISTERS=hopper.CONSUMER_REGISTERS)
    signature.update({key: "constexpr" for key in constants})
    source = GluonASTSource(_lm_head_group_top2_pingpong_kernel, signature, constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return dict(launch_registers=int(found.group(1)), stack=int(found.group(2)), shared=compiled.metadata.shared,
                setmaxnreg=sorted(set(re.findall(r"USETMAXREG[^;]*", sass))), sass_lines=sass.count("\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="sm_90 compile on this machine, no GPU")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.compile_only:
        print(compile_for_sm90())
        return
    run_on_gpu(args.repeats)


def check_against_triton(hidden, weight) -> None:
    """Prints the fraction of each summary that differs from the Triton kernel's (expected 0)."""
    vocab = weight.shape[0]
    theirs = EpilogueMatmul(hidden, weight, None, vocab, 1.0, None, group_top2=True)(0, vocab)
    for block_shape in ((128, 128, 64), (64, 256, 64)):
        ours = pingpong_summaries(hidden, weight, block_shape, 4, 16)
        groups = min(ours.group_max.shape[1], theirs.group_max.shape[1])  # past the width: one group run more
        names = ["group_max", "group_arg", "group_second"] + (["tile_max2", "tile_sum2"] if block_shape[1] == 256
                                                               else [])
        for name in names:
            a, b = getattr(ours, name), getattr(theirs, name)
            a, b = (a[:, :groups], b[:, :groups]) if name.startswith("group") else (a, b)
            differ = (a.float() != b.float()).float().mean().item()
            print(f"check {block_shape}: {name} differs from the Triton kernel's in {differ:.2e} of entries")


def run_on_gpu(repeats: int) -> None:
    from harness import teacher_s1, time_interleaved_ms, time_ms

    torch.manual_seed(0)
    hidden, weight = teacher_s1()
    rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    flops = 2 * rows * hidden_size * vocab
    check_against_triton(hidden, weight)
    # two sets of inputs in turn (fresh values, the same LLM-like scale)
    inputs = itertools.cycle([(hidden,), (hidden[torch.randperm(rows, device="cuda")].contiguous(),)])
    cases = {"cuBLAS bf16": lambda h: h @ weight.T,
             "triton statistics only": lambda h: EpilogueMatmul(h, weight, None, vocab, 1.0, None)(0, vocab),
             "triton group top-2": lambda h: EpilogueMatmul(h, weight, None, vocab, 1.0, None,
                                                           group_top2=True)(0, vocab)}
    for bm, bn, bk, stages, group_m in SWEEP:
        cases[f"ping-pong top-2 {bm} x {bn} x {bk}, {stages} stages, GROUP_M {group_m}"] = (
            lambda h, c=(bm, bn, bk, stages, group_m): pingpong_summaries(h, weight, c[:3], c[3], c[4]))
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = time_ms(fn, lambda: next(inputs), repeats=repeats)[0]
        except Exception as error:  # a form that does not compile or launch is a finding, not a stop
            print(f"{name}: {type(error).__name__}: {str(error)[:300]}")
    floor = results["cuBLAS bf16"]
    print(f"\n{rows} x {hidden_size} x {vocab} bf16, in blocks, median of {repeats}")
    print("| case | ms | TFLOP/s | x cuBLAS |\n| --- | --- | --- | --- |")
    for name, ms in results.items():
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {ms / floor:.3f} |")
    pingpong = sorted((ms, name) for name, ms in results.items() if name.startswith("ping-pong"))[:2]
    chosen = ["cuBLAS bf16", "triton group top-2"] + [name for _, name in pingpong]
    second = next(inputs)[0]
    in_turn, ratios = time_interleaved_ms({name: (cases[name], lambda: (second,)) for name in chosen})
    print("\n| case (in turn) | ms | median ratio to cuBLAS |\n| --- | --- | --- |")
    for name in chosen:
        print(f"| {name} | {in_turn[name][0]:.3f} | {ratios[name]:.3f} |")


if __name__ == "__main__":
    main()
