"""Each row's top-k from the elements the appending matmul kept (ops/lm_head_group_maxima.py
with `Appends`): no logits stored, no group summaries, memory independent of V.

Before a chunk's matmul, a sample of its columns (every ``stride``-th, by the epilogue matmul:
1/stride of the flops) gives each row a floor: a lower bound of the sample's r-th largest
logit, with r a few standard deviations above the k/stride top-k elements a sample holds on
average. The matmul then appends every element at or above its row's floor (~r · stride a row)
to the row's keys, and one sort per row ranks them. Exact whatever the floor: when at least k
elements reach it, the row's k-th largest does too, so every top-k element (and every tie of
the k-th) is among the keys; rows with fewer than k (a floor above the k-th largest: a sample
holding r of the top-k) or more than the capacity (massive ties) are flagged for the caller's
exact redo.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED
from .sort_keys import top_of_counted_keys
from .utils import kth_largest_lower_bound, row_logsumexp

# every SAMPLE_STRIDE-th column sampled for the floors: a sparser sample costs the sampling matmul
# less and the sorts more (more keys a row); at LLM vocabularies a sample fits one block of the
# floors kernel
SAMPLE_STRIDE = 50
# the sample keeps at least this many columns per k (the stride falls below SAMPLE_STRIDE where it
# would not), so the floor's rank r ~ k / stride + 5 sigmas sits well inside it
SAMPLE_COLUMNS_PER_K = 2
SAMPLE_SIGMAS = 5.0  # r over the sample's mean count of top-k elements, in its standard deviations
KEY_SIGMAS = 6.0  # the key slots over the elements a floor keeps on average, in standard deviations
FLOOR_STEPS = 12  # value-space bisection steps of the floor (a lower bound: more steps, fewer keys)
MAX_KEYS = 4096  # the extension's sort per row (csrc/sort_keys.cu) takes at most this many slots
ROW_WARPS = 1 if INTERPRETED else 4  # the floors and the lse: a program a row


def sample_rank(k: int, stride: int, sample_width: int) -> int:
    """r: the floor is the sample's r-th largest. A sample of every stride-th column holds
    ~k / stride of a row's top k (Binomial(k, 1 / stride) where ids and ranks are unrelated);
    r sits SAMPLE_SIGMAS standard deviations above that, so the floor is below the k-th largest
    in all but ~1e-7 of rows. At most the sample's width (then the floor is its smallest)."""
    mean = k / stride
    return min(sample_width, math.ceil(mean + SAMPLE_SIGMAS * math.sqrt(mean * (1 - 1 / stride))) + 2)


def key_capacity(k: int, stride: int, rank: int) -> int:
    """Key slots a row: a power of two (the sort's) above the ~rank · stride elements a floor
    keeps on average plus KEY_SIGMAS of their spread (the floor's rank in the whole row is about
    a sum of rank gaps of ~stride columns each: standard deviation ~stride · sqrt(rank)), at least
    2k, at most MAX_KEYS. Rows past it are redone."""
    wanted = max(2 * k, math.ceil(rank * stride + KEY_SIGMAS * stride * math.sqrt(rank)))
    return min(MAX_KEYS, triton.next_power_of_2(wanted))


@dataclasses.dataclass(frozen=True)
class AppendedPlan:
    """The sample and the keys of the appended schedule for one vocabulary width and k: every
    ``stride``-th column sampled (``sample_width`` of them, rows padded to ``sample_columns``
    for 16-byte alignment), the floor at the sample's ``rank``-th largest, ``capacity`` key
    slots a row."""
    stride: int
    sample_width: int
    sample_columns: int
    rank: int
    capacity: int


def appended_plan(width: int, k: int, stride: int | None = None) -> AppendedPlan:
    """`AppendedPlan` for ``width`` columns and k; ``stride`` None: SAMPLE_STRIDE, or less where
    the sample would hold fewer than SAMPLE_COLUMNS_PER_K · k columns."""
    stride = stride or max(1, min(SAMPLE_STRIDE, width // (SAMPLE_COLUMNS_PER_K * k)))
    sample_width = -(-width // stride)
    rank = sample_rank(k, stride, sample_width)
    return AppendedPlan(stride, sample_width, -(-sample_width // 8) * 8, rank, key_capacity(k, stride, rank))


@triton.jit
def _sample_floor_kernel(sample_ptr, stride_row, floors_ptr, sample_width, rank, SAMPLE: tl.constexpr,
                         STEPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, SAMPLE)
    valid = offsets < sample_width
    values = tl.load(sample_ptr + row * stride_row + offsets, mask=valid, other=float("-inf")).to(tl.float32)
    low = kth_largest_lower_bound(values, valid, rank, STEPS)  # rank <= sample_width: enough are valid
    # finite: elements past the width are -inf in the matmul and must never reach a floor
    tl.store(floors_ptr + row, tl.maximum(low, -3.4028234663852886e38))


def sample_floors(sample: torch.Tensor, rank: int, floors: torch.Tensor) -> torch.Tensor:
    """sample ``[R, S]`` logits (any float dtype, unit stride along a row) -> ``floors [R]``
    float32 filled: per row a lower bound of its rank-th largest (its smallest where S <= rank),
    never -inf."""
    rows, width = sample.shape
    if rows:
        _sample_floor_kernel[(rows,)](sample, sample.stride(0), floors, width, rank,
                                      SAMPLE=triton.next_power_of_2(width), STEPS=FLOOR_STEPS,
                                      num_warps=ROW_WARPS)
    return floors


@triton.jit
def _tile_logsumexp_kernel(tile_max2_ptr, tile_sum2_ptr, lse_ptr, tiles, TILES: tl.constexpr):
    row_logsumexp(tile_max2_ptr, tile_sum2_ptr, lse_ptr, tl.program_id(0).to(tl.int64), tiles, TILES)


def tile_logsumexp(tile_max2: torch.Tensor, tile_sum2: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``lse [R]`` float32 filled with the rows' logsumexp at τ (natural units) from their
    tiles' (max, sum of exp) in log2 units ``[R, tiles]`` (contiguous); one program a row, no
    temporaries (a torch logsumexp held ~4 copies of the statistics)."""
    rows, tiles = tile_max2.shape
    if rows:
        _tile_logsumexp_kernel[(rows,)](tile_max2, tile_sum2, lse, tiles, TILES=triton.next_power_of_2(tiles),
                                        num_warps=ROW_WARPS)
    return lse


def rank_appended(keys: torch.Tensor, counts: torch.Tensor, k: int, order: str):
    """keys ``[R, capacity]`` int64 raw (the appending matmul's), counts ``[R]`` int32 (may pass
    the capacity), ``order`` "cuda" (the extension's sort) or "triton" (one Triton program a row)
    -> (the k largest values ``[R, k]`` float32 in order, -inf past a row's count; columns
    ``[R, k]`` int32; overflow ``[R]`` bool: fewer than k keys or more than the capacity, rows to
    redo)."""
    capacity = keys.shape[1]
    overflow = (counts < k) | (counts > capacity)
    values, columns = top_of_counted_keys(keys, counts.clamp(max=capacity), k, order)
    return values, columns, overflow
