"""Launch configurations of the Triton kernels, in one place (no autotuning by default)."""
import functools
import os

import torch

# Under Triton's CPU interpreter (tests) the kernels take small blocks and one warp: it pays
# per element and per step, and runs fp32 / fp16 only. Read once: TRITON_INTERPRET must be set
# before the kernels are defined anyway.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Columns per step of the row-streaming kernels: wide steps of 16 warps keep HBM busy.
ROW_BLOCK_V = 64 if INTERPRETED else 2048


# The statistics pass that also writes the exponentials (one read). Its per-block maximum (does
# the row's shift move?) is a block-wide reduction, which small programs take cheaply, many of
# them per SM keeping HBM busy; with few rows (the lean schedule's chunks) 4-warp programs leave
# too few warps per SM, so the program grows until the launch holds ~ONE_READ_TARGET_WARPS.
ONE_READ_COLUMNS_PER_WARP = 256
ONE_READ_TARGET_WARPS = 8192


def one_read_launch(rows: int):
    """(BLOCK_V, num_warps) of the one-read pass over ``rows`` rows."""
    if INTERPRETED:
        return 64, 1
    warps = 4
    while warps < 16 and rows * warps < ONE_READ_TARGET_WARPS:
        warps *= 2
    return ONE_READ_COLUMNS_PER_WARP * warps, warps


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 128))


# Bisection steps of the top-k threshold (ops/topk_threshold.py): any lower bound is exact,
# fewer steps only admit more candidates; the interpreter pays per step, the GPU does not.
THRESHOLD_BISECTIONS = 8 if INTERPRETED else 24


def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device (persistent grids size themselves by it)."""
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_index: int) -> int:
    # cached: `torch.cuda.get_device_properties` is host work a launch
    return torch.cuda.get_device_properties(device_index).multi_processor_count
