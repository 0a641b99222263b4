"""The teacher's epilogue matmul compiled for sm_90 on this machine (no GPU needed: Triton's
bundled ptxas and cuobjdump): instructions of the kernel, of its hottest loop, registers, stack
and spills, per set of compile-time switches. The e28 calibration (NOTES) reads ~1300
instructions a tile-thread as ~4.5 % of the matmul's time at 128 × 256 tiles on 8 warps.

usage: python benchmarks/sass_probe.py [--variants statistics,top2,append] [--sass-dir DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kd_kernels.ops import lm_head_group_maxima as epilogue  # noqa: E402

SIGNATURE = {"hidden_desc": "tensordesc<bf16[128,64]>", "weight_desc": "tensordesc<bf16[256,64]>",
             "logits_desc": "tensordesc<bf16[128,64]>", "bias_ptr": "*fp32", "tile_max2_ptr": "*fp32",
             "tile_sum2_ptr": "*fp32", "group_max_ptr": "*fp32", "group_arg_ptr": "*fp32",
             "group_second_ptr": "*fp32", "num_rows": "i32", "width": "i32", "column_offset": "i32",
             "hidden_size": "i32", "log2e_over_t": "fp32", "floor_ptr": "*fp32", "keys_ptr": "*i64",
             "counts_ptr": "*i32", "key_capacity": "i32"}
COMMON = dict(HAS_BIAS=False, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, NUM_PROGRAMS=132,
              GROUP_COLUMNS=32, SUBTILE=True, FLATTEN=True, DOT_PRECISION="tf32", STORE_LOGITS=False)
VARIANTS = {"statistics": dict(GROUP_TOP2=False, APPEND=False),
            "top2": dict(GROUP_TOP2=True, APPEND=False),
            "append": dict(GROUP_TOP2=False, APPEND=True, APPEND_IN_PTX=True),
            "append triton-stores": dict(GROUP_TOP2=False, APPEND=True, APPEND_IN_PTX=False)}


def sass_of(constants: dict, sass_dir: str | None, name: str) -> str:
    signature = dict(SIGNATURE, **{key: "constexpr" for key in constants})
    source = ASTSource(epilogue._lm_head_group_maxima_kernel, signature, constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        with open(os.path.join(sass_dir, f"{name.replace(' ', '_')}.sass"), "w") as out:
            out.write(sass)
    return sass, usage


def loop_instructions(sass: str) -> int:
    """Instructions between the last backward branch and its target: the persistent loop."""
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    addresses = [int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16) for line in lines]
    loops = []
    for address, line in zip(addresses, lines):
        target = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < address:
            loops.append((address - int(target.group(1), 16)) // 16)
    return max(loops, default=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--sass-dir", default=None)
    args = parser.parse_args()
    print(f"{'variant':<17} {'instructions':>12} {'loop':>6} {'registers':>9} {'stack':>6} {'shuffles':>8}")
    for name in args.variants.split(","):
        sass, usage = sass_of(dict(COMMON, **VARIANTS[name]), args.sass_dir, name)
        instructions = len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))
        registers = re.search(r"REG:(\d+)", usage).group(1)
        stack = re.search(r"STACK:(\d+)", usage).group(1)
        print(f"{name:<17} {instructions:>12} {loop_instructions(sass):>6} {registers:>9} {stack:>6} "
              f"{sass.count('SHFL'):>8}")


if __name__ == "__main__":
    main()
