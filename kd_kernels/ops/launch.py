"""Launch configurations of the Triton kernels, in one place (no autotuning by default)."""
import os

# Columns per step of the row-streaming kernels; small under the CPU interpreter.
# H200, [2048, 151,936] fp32 (benchmarks/tune_row_kernels.py, NOTES.md): 2048 columns with
# 16 warps read 3.97 TB/s (logsumexp, τ = 1), 2.99 TB/s (two sums, τ ≠ 1), and the in-place
# gradient moves 4.06 TB/s; a device copy reaches 4.22 TB/s.
ROW_BLOCK_V = 64 if os.environ.get("TRITON_INTERPRET") == "1" else 2048


# The statistics pass that also writes the exponentials (one read). Its per-block maximum (does
# the row's shift move?) is a block-wide reduction; small programs take it cheaply and many of
# them per SM keep HBM busy. H200, [2048, 151,936] (tune_row_kernels.py, 4 B read + 2 B written
# per column): 1024 / 4 warps 3.41 TB/s, 2048 / 8 3.26, 4096 / 16 3.09, 8192 / 16 2.68.
ONE_READ_BLOCK_V = 64 if os.environ.get("TRITON_INTERPRET") == "1" else 1024
ONE_READ_WARPS = 4


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 128))


# Bisection steps of the top-k threshold (ops/topk_threshold.py): any lower bound is exact,
# fewer steps only admit more candidates; the interpreter pays per step, the GPU does not.
THRESHOLD_BISECTIONS = 8 if os.environ.get("TRITON_INTERPRET") == "1" else 24
