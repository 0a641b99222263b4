"""The maxima schedule's lm_head matmul as a Hopper ping-pong kernel (Gluon): the same group top-2
summaries as the Triton epilogue matmul's ``group_top2`` form (ops/lm_head_group_maxima.py),
with the epilogue off the tensor cores' critical path.

The Triton kernel is cooperative: 8 warps share one 128 × 256 accumulator, so while a tile's
epilogue (Σ exp, each interleaved group's maximum, its lane and second largest) runs, the tensor
cores idle: 1.034-1.058× cuBLAS on an H200. Here two 4-warp consumers each own a 128 × 128 tile
and take every other tile of the program's sequence; a producer partition feeds both from one
TMA ring in tile order, and an order barrier pair makes the mainloops alternate, so one
consumer's epilogue runs under the other's mainloop: 1.015-1.034× cuBLAS in blocks (the Triton
kernel 1.034-1.037 in the same runs), 0.988× timed in turn (1.058-1.069), at 8192 × 4096 ×
151,936 bf16 in one launch (benchmarks/gluon_pingpong_probe.py, NOTES e38). Opt-in
(`top2_matmul_choice`): in the maxima schedule it wins only timed in turn. Its
outputs are bit-identical to the Triton kernel's groups (same wgmma steps over the hidden size,
same reductions); its tile statistics are per 128 columns instead of 256 (the selection reads
the tile width from the summaries' shapes).

Hopper (sm_90) only: Gluon's warpgroup MMA and register reallocation are that architecture's.
"""
from __future__ import annotations

import functools
import os

import torch

from .buffers import empty_parts
from .launch import multiprocessor_count
from .lm_head_group_maxima import RowSummaries
from .tma import tma_rows

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
GROUP_COLUMNS = 32
# H200, 8192 rows (benchmarks/gluon_pingpong_probe.py): 5 stages 1.015× cuBLAS, 6 stages 1.036;
# GROUP_M 16 row tiles per weight tile 1.015, 32 1.084 (64 at 6 stages: 1.371; the L2 working set
# of the 264 tiles in flight)
STAGES = 5
GROUP_M = 16
# each consumer holds a 128-register accumulator and the epilogue's temporaries; the producer
# partition gives its registers back
CONSUMER_REGISTERS = 232

TOP2_MATMULS = ("triton", "pingpong")


def top2_matmul_choice(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """"triton" (the epilogue matmul, the default) or "pingpong" (this kernel) for the group top-2
    summaries of ``hidden @ weight.T``, from ``KD_KERNELS_TOP2_MATMUL``. This kernel is opt-in:
    timed in turn with the bare matmul the schedule is faster with it (k = 64: 1.121 against
    1.162× the matmul), back to back it is slower (its 128 × 128 tiles move a third more bytes
    from L2 at the card's power limit, and its 128-column tile statistics cost the selection
    ~0.15 ms: NOTES e38). Asking for it where it cannot run is an error naming why."""
    requested = os.environ.get("KD_KERNELS_TOP2_MATMUL", "triton")
    if requested not in TOP2_MATMULS:
        raise ValueError(f"KD_KERNELS_TOP2_MATMUL: expected one of {TOP2_MATMULS}, got {requested!r}")
    reason = _pingpong_unusable(hidden, weight) if requested == "pingpong" else ""
    if reason:
        raise ValueError(f"KD_KERNELS_TOP2_MATMUL=pingpong: {reason}")
    return requested


@functools.lru_cache(maxsize=None)
def _gluon_importable() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def _pingpong_unusable(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """Why this kernel cannot take these inputs ("" where it can)."""
    if hidden.device.type != "cuda":
        return f"needs CUDA tensors, got {hidden.device}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter runs no Gluon kernels"
    if torch.cuda.get_device_capability(hidden.device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(hidden.device)
        return f"needs an sm_90 GPU (Hopper), got sm_{major}{minor}"
    if not _gluon_importable():
        return "needs triton.experimental.gluon with its Hopper module (triton >= 3.6)"
    if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
        return f"needs bf16 / fp16 hidden and weight of one dtype, got {hidden.dtype} and {weight.dtype}"
    if not (tma_rows(hidden) and tma_rows(weight)):
        return "needs rows TMA can move (contiguous, 16-byte aligned: a hidden size that is a multiple of 8)"
    return ""


def empty_top2_summaries(rows: int, width: int, tile_columns: int, device) -> RowSummaries:
    """Unfilled `RowSummaries` of the group top-2 form for ``rows`` rows of ``width`` columns in
    tiles of ``tile_columns`` (a multiple of 4 · GROUP_COLUMNS)."""
    column_tiles = -(-width // tile_columns)
    groups = column_tiles * (tile_columns // GROUP_COLUMNS)
    tile_max2, tile_sum2, group_max, group_arg, group_second = empty_parts(
        device, ((rows, column_tiles), torch.float32), ((rows, column_tiles), torch.float32),
        ((rows, groups), torch.float32), ((rows, groups), torch.int8), ((rows, groups), torch.float32))
    return RowSummaries(tile_max2, tile_sum2, group_max, GROUP_COLUMNS, group_arg, group_second)


def group_top2_summaries(hidden: torch.Tensor, weight: torch.Tensor, bias, width: int, temperature: float,
                         column_start: int = 0) -> RowSummaries:
    """hidden ``[R, H]``, weight ``[≥ column_start + width, H]`` (bf16 / fp16, one dtype, on an
    sm_90 GPU), bias ``[≥ column_start + width]`` or None -> the `RowSummaries` of the columns
    ``column_start … column_start + width`` of ``hidden @ weight.T + bias`` in the
    ``group_top2`` form (interleaved groups of 32 columns, `top2_group_columns`), with tile
    statistics per 128 columns. No logits are stored."""
    from .lm_head_group_top2_pingpong import launch_group_top2_pingpong
    from .topk_from_groups import LOG2E

    reason = _pingpong_unusable(hidden, weight)
    if reason:
        raise ValueError(f"hidden, weight: the Hopper group top-2 matmul {reason}")
    rows = hidden.shape[0]
    summaries = empty_top2_summaries(rows, width, BLOCK_N, hidden.device)
    if rows:
        launch_group_top2_pingpong(hidden, weight, bias, summaries, width, column_start,
                                   LOG2E / temperature, multiprocessor_count(hidden.device))
    return summaries
