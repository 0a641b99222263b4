"""Each row's top-k from the elements the appending matmul logged (ops/lm_head_group_maxima.py
with `Appends`): no logits stored, no group summaries, memory independent of V.

Before a chunk's matmul, a sample of its columns (every ``stride``-th: ~1/19 of the flops) gives
each row a floor: a lower bound of the sample's r-th largest logit, with r a few standard
deviations above the k/stride top-k elements a sample holds on average. The matmul then logs
every element at or above its row's floor (~r · stride a row, ~1.7k at k = 1024) in its
program's log of the row's place in a tile, and one kernel a row gathers the row's entries from
those logs and sorts them. Exact whatever the floor: when at least k elements reach it, the
row's k-th largest does too, so every top-k element (and every tie of the k-th) is among the
entries; rows with fewer than k (a floor above the k-th largest: a sample holding r of the
top-k), more than MAX_KEYS (massive ties) or a log that lost entries are flagged for the
caller's exact redo.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from .lm_head_group_maxima import LOG_COLUMN_BITS
from .sort_keys import decode_keys, value_column_keys
from .topk_from_groups import row_logsumexp
from .utils import kth_largest_lower_bound

# every SAMPLE_STRIDE-th column sampled for the floors: 1/19 of the flops, ~8k columns at V = 151,936
SAMPLE_STRIDE = 19
SAMPLE_SIGMAS = 5.0  # r over the sample's mean count of top-k elements, in its standard deviations
LOG_SIGMAS = 6.0  # a log's slots over the entries it gets on average, in standard deviations (and 1.5x)
FLOOR_STEPS = 12  # value-space bisection steps of the floor (a lower bound: more steps, fewer keys)
MAX_KEYS = 4096  # the extension's ranking (csrc/rank_appends.cu) gathers at most this many entries a row
RANK_PIECE_BYTES = 8 << 20  # the torch ranking's temporaries (~4 copies of the entries) per piece of row tiles
ROW_WARPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 4  # the floors and lse: a program a row


def sample_rank(k: int, stride: int, sample_width: int) -> int:
    """r: the floor is the sample's r-th largest. A sample of every stride-th column holds
    ~k / stride of a row's top k (Binomial(k, 1 / stride) where ids and ranks are unrelated);
    r sits SAMPLE_SIGMAS standard deviations above that, so the floor is below the k-th largest
    in all but ~1e-7 of rows. At most the sample's width (then the floor is its smallest)."""
    mean = k / stride
    return min(sample_width, math.ceil(mean + SAMPLE_SIGMAS * math.sqrt(mean * (1 - 1 / stride))) + 2)


def log_capacity(entries_a_row: float, rows: int, width: int, programs: int, block_m: int, block_n: int) -> int:
    """Entries a log holds (`Appends`): a program's log of one row-of-tile gets, from each of its
    tiles, that row's elements at or above the floor (``entries_a_row`` · block_n / width on
    average); 1.5x its mean over the program's tiles (rows whose counts run high) plus
    LOG_SIGMAS of Poisson spread. A log past it loses entries: its rows are redone."""
    row_tiles, column_tiles = -(-rows // block_m), -(-width // block_n)
    tiles = -(-row_tiles * column_tiles // programs)
    mean = tiles * entries_a_row / column_tiles
    return math.ceil(1.5 * mean + LOG_SIGMAS * math.sqrt(mean) + 8)


@dataclasses.dataclass(frozen=True)
class AppendedPlan:
    """The sample of the appended schedule for one vocabulary width and k: every ``stride``-th
    column sampled (``sample_width`` of them, rows padded to ``sample_columns`` for 16-byte
    alignment), the floor at the sample's ``rank``-th largest: ~rank · stride entries a row."""
    stride: int
    sample_width: int
    sample_columns: int
    rank: int

    @property
    def entries_a_row(self) -> int:
        return self.rank * self.stride


def appended_plan(width: int, k: int, stride: int | None = None) -> AppendedPlan:
    """`AppendedPlan` for ``width`` columns and k; ``stride`` None: SAMPLE_STRIDE, or less where
    the vocabulary is small (a sample of at least ~8k columns keeps r well inside it)."""
    stride = stride or max(1, min(SAMPLE_STRIDE, width // (8 * k)))
    sample_width = -(-width // stride)
    rank = sample_rank(k, stride, sample_width)
    return AppendedPlan(stride, sample_width, -(-sample_width // 8) * 8, rank)


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


def rank_appended(logs: torch.Tensor, log_counts: torch.Tensor, row_tiles_seen: torch.Tensor, rows: int, k: int,
                  order: str):
    """The appending matmul's `Appends` logs ``[programs, block_m, capacity]`` int64,
    ``log_counts [programs, block_m]`` int32 and ``row_tiles_seen [programs, row_tiles]`` int8
    -> (each of ``rows`` rows' k largest values ``[rows, k]`` float32 in order, -inf past its
    entries; columns ``[rows, k]`` int32; overflow ``[rows]`` bool: fewer than k entries, more
    than MAX_KEYS or a log of the row lost some: rows to redo). ``order``: "cuda" (the
    extension's gather and sort a row) or "torch" (sorts in pieces of row tiles)."""
    if order == "cuda":
        from .topk_candidates import load_extension

        return load_extension().rank_appends(logs, log_counts, row_tiles_seen, rows, k)
    programs, block_m, capacity = logs.shape
    row_tiles = -(-rows // block_m)
    seen = row_tiles_seen.bool()
    filled = torch.arange(capacity, device=logs.device) < log_counts.clamp(max=capacity).unsqueeze(-1)
    tags = (logs & 0xFFFFFFFF) >> LOG_COLUMN_BITS.value
    lost = (seen.unsqueeze(2) & (log_counts > capacity).unsqueeze(1)).any(0).flatten()[:rows]  # [row_tiles · block_m]
    values = torch.full((rows, k), float("-inf"), device=logs.device)
    columns = torch.zeros(rows, k, dtype=torch.int32, device=logs.device)
    counts = torch.zeros(rows, dtype=torch.int64, device=logs.device)
    per_tile = max(1, int((log_counts.clamp(max=capacity).sum() // max(1, row_tiles)).item()))
    piece = max(1, RANK_PIECE_BYTES // (32 * per_tile))  # row tiles a piece
    for first_tile in range(0, row_tiles, piece):
        taken = filled & (tags >= first_tile) & (tags < first_tile + piece)
        entries = logs[taken]
        place = torch.arange(block_m, device=logs.device).view(1, block_m, 1).expand_as(logs)[taken]
        row = tags[taken] * block_m + place
        keys = value_column_keys((entries >> 32).to(torch.int32).view(torch.float32),
                                 entries & ((1 << LOG_COLUMN_BITS.value) - 1))
        keys, order_by_key = torch.sort(keys, descending=True)
        row, order_by_row = torch.sort(row[order_by_key], stable=True)
        keys = keys[order_by_row]
        piece_counts = torch.bincount(row, minlength=rows)
        starts = torch.cumsum(piece_counts, 0) - piece_counts
        rank = torch.arange(len(row), device=logs.device) - starts[row]
        top = rank < k
        top_values, top_columns = decode_keys(keys[top])
        values[row[top], rank[top]] = top_values
        columns[row[top], rank[top]] = top_columns.to(torch.int32)
        counts += piece_counts
    return values, columns, lost | (counts < k)
