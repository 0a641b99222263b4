"""Launch configurations of the Triton kernels, in one place (no autotuning by default)."""
import functools
import os

import torch

# Columns per step of the row-streaming kernels; small under the CPU interpreter.
# H200, [2048, 151,936] fp32 (benchmarks/tune_row_kernels.py, NOTES.md): 2048 columns with
# 16 warps read 3.97 TB/s (logsumexp, τ = 1), 2.99 TB/s (two sums, τ ≠ 1), and the in-place
# gradient moves 4.06 TB/s; a device copy reaches 4.22 TB/s.
ROW_BLOCK_V = 64 if os.environ.get("TRITON_INTERPRET") == "1" else 2048


# The statistics pass that also writes the exponentials (one read). Its per-block maximum (does
# the row's shift move?) is a block-wide reduction, which small programs take cheaply, many of
# them per SM keeping HBM busy. H200, [2048, 151,936] (tune_row_kernels.py, 4 B read + 2 B
# written per column): 1024 columns / 4 warps 3.46 TB/s, 2048 / 8 3.31, 4096 / 16 3.09; fewer
# rows (the lean schedule's 384) leave 4-warp programs too few warps per SM, so the program
# grows until the launch holds ~8192 warps.
ONE_READ_COLUMNS_PER_WARP = 256
ONE_READ_TARGET_WARPS = 8192


def one_read_launch(rows: int):
    """(BLOCK_V, num_warps) of the one-read pass over ``rows`` rows."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 64, 1
    warps = 4
    while warps < 16 and rows * warps < ONE_READ_TARGET_WARPS:
        warps *= 2
    return ONE_READ_COLUMNS_PER_WARP * warps, warps


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 128))


# Bisection steps of the top-k threshold (ops/topk_threshold.py): any lower bound is exact,
# fewer steps only admit more candidates; the interpreter pays per step, the GPU does not.
THRESHOLD_BISECTIONS = 8 if os.environ.get("TRITON_INTERPRET") == "1" else 24


def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device (persistent grids size themselves by it)."""
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_index: int) -> int:
    # cached: `torch.cuda.get_device_properties` is host work a launch
    return torch.cuda.get_device_properties(device_index).multi_processor_count
