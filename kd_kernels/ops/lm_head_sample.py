"""The lm_head matmul whose epilogue keeps the elements that may be among a row's Gumbel-top-n
keys: the teacher's sampling without stored logits (kd_kernels/teacher_sampling.py).

The persistent TMA matmul of ops/lm_head_group_maxima.py (its tiles, L2 grouping and column
groups) with another epilogue. Per row it keeps the tile statistics of ``z / τ`` (the
logsumexp, from the un-noised logits) and appends to the row's keys every element that may have
``κ = z / τ + G ≥ f`` for the row's floor f (`SampleAppends`, f in key units): with
``E = e^{−G}`` (Exp(1)), ``κ ≥ f ⇔ E ≤ X = exp(z / τ − f)``, and ``E ≥ w ≥ coarse · 2⁻¹⁶`` (the
noise's uniform w and its 16 coarse bits: kd_kernels/sampling.py), so the test
``coarse ≤ X · 2¹⁶`` keeps a superset of the elements at or above the floor, at most
``min(1, X + 2⁻¹⁶)`` of each where ``1 − e^{−X}`` reach it. One exponential an element serves
both the statistics and the test: ``t = exp2(z · log2e / τ − s)`` with the row's shift
``s = f · log2e − MARGIN2`` (the floor lowered by MARGIN2, far more than the approximate exp2's
error and the keys' float32 rounding, so every element whose float32 key, as the rank pass
computes it in ops/sample_keys.py, is ≥ f is kept), so t is X · 2^MARGIN2, and each tile's
(shift, sum of t) is its share of the logsumexp, with no tile maximum. Per element: a share of
one hash a pair of columns, the coarse bits, one fma and one compare. Where t underflows (an
element over 87 · τ nats below the floor) the test keeps only the coarse bits' zero, as it
should, and the sum loses under 2⁻⁷⁰ of the row's for V ≤ 2²² (the row's largest t is at least
2⁻³³: the noise stops at 22.9 nats); a tile whose sum passes 2^MAX_EXCESS2 (an
element that far above the floor) counts its row past the capacity, so the logits schedule
redoes it exactly (one branch-free epilogue for every tile).

The keys are raw, as the top-k's appending matmul stores them: the logit's float bits (before
τ, bias included) above the global column; the rank pass adds the exact noise.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from ..sampling import COARSE_BITS
from .buffers import empty_parts
from .gumbel_noise import _M1, _M2, coarse_floats, row_key, signed_key
from .launch import multiprocessor_count
from .lm_head_group_maxima import (POPC_IN_HARDWARE, _check_appends, _popcount, _thread_groups, _tile_position,
                                   default_config, top2_group_columns, top2_group_pairs)
from .tma import row_tile_descriptor

MARGIN2 = 1.0 / 512  # log2 units (1.35e-3 nats) each row's floor is lowered by
MAX_EXCESS2 = 100.0  # a row whose tile sum of 2^(key − floor) passes 2^this (log2 units) is redone
_LOG2E = tl.constexpr(1.4426950408889634)
_MARGIN2 = tl.constexpr(MARGIN2)
_TWO_POW_23 = tl.constexpr(8388608.0)
_COARSE_SCALE = tl.constexpr(2.0 ** COARSE_BITS)  # X in units of the coarse bits
_MAX_SUM2 = tl.constexpr(2.0 ** MAX_EXCESS2)

# the interpreter has no inline PTX: the appends' stores in Triton there (tests), in PTX on GPUs
STORE_IN_PTX = os.environ.get("TRITON_INTERPRET") != "1"

# one element's append, its group's slots taken: where its lane's bit ($2) is set in the group's
# bits ($3; cleared for a group whose slots would pass the capacity), at the group's first slot's
# address ($5) + 8 · the group's kept lanes below it (bits & below), the 8-byte raw key (column,
# value bits) in one predicated store: no branch, and no keep flags held from the test to the
# store (ops/lm_head_group_maxima.py's `_STORE_APPENDED_PTX`)
_STORE_KEPT_PTX = tl.constexpr("""
{
.reg .pred kept;
.reg .b32 slot;
.reg .b64 address;
mov.u32 $0, 0;
and.b32 slot, $3, $2;
setp.ne.b32 kept, slot, 0;
and.b32 slot, $3, $4;
popc.b32 slot, slot;
mad.wide.u32 address, slot, 8, $5;
@kept st.global.v2.b32 [address], {$6, $1};
}
""")


@dataclasses.dataclass
class SampleAppends:
    """Where the sampling matmul appends: ``floors [R]`` float32 (key units ``z / τ + G``),
    ``keys [R, capacity]`` int64 raw (slots past a row's count are junk), ``counts [R]`` int32
    (zero before the matmul; after it, the elements kept, which may pass the capacity)."""
    floors: torch.Tensor
    keys: torch.Tensor
    counts: torch.Tensor


@triton.jit
def _kept_bits(bound_even, bound_odd, hash_base, pair_share, even_bit):
    """Each group's bits [BLOCK_M, groups] int32 of the lanes kept: an element's coarse noise bits
    (as the float 2^23 + coarse) at or under its bound (2^23 + X · 2^16). One hash a pair of
    columns: ``pair_mix(key + pair)`` with its first product split as ``hash_base + pair_share``."""
    h = hash_base + pair_share
    h = h ^ (h >> 15)
    h = h * _M2
    coarse_even, coarse_odd = coarse_floats(h ^ (h >> 16))
    kept = tl.where(coarse_even <= bound_even, even_bit, 0) + tl.where(coarse_odd <= bound_odd, even_bit << 1, 0)
    return tl.sum(kept, axis=2)


@triton.jit
def _store_kept(z, lane_bit, bits, below, first, column, row_offsets, keys_ptr, key_capacity, IN_PTX: tl.constexpr):
    """Elements ``z`` [BLOCK_M, groups, pairs] whose ``lane_bit`` is set in their group's ``bits``
    stored as raw keys in their slots: ``first`` [BLOCK_M, groups] + the group's kept lanes below
    (``bits & below``); each group's slots within ``key_capacity`` (its bits cleared otherwise)."""
    if IN_PTX:
        # the group's first slot's address, once a group rather than once an element
        first_slot = (keys_ptr + row_offsets[:, None] * key_capacity + first).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise(_STORE_KEPT_PTX, "=r,f,r,r,r,l,r",
                                  [z, lane_bit, bits[:, :, None], below, first_slot[:, :, None], column],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        slot = first[:, :, None] + _popcount(bits[:, :, None] & below, POPC_IN_HARDWARE)
        raw_key = (z.to(tl.int32, bitcast=True).to(tl.int64) << 32) | column.to(tl.int64)
        place = row_offsets[:, None, None] * key_capacity + slot
        tl.store(keys_ptr + place, raw_key, mask=(bits[:, :, None] & lane_bit) != 0)


@triton.jit(do_not_specialize=["seed_key", "row_start", "first_row"])
def _lm_head_sample_kernel(hidden_desc, weight_desc, bias_ptr, tile_max2_ptr, tile_sum2_ptr, floor_ptr, keys_ptr,
                           counts_ptr, row_start, num_rows, width, noise_offset, hidden_size, log2e_over_t,
                           key_capacity, seed_key, first_row, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           NUM_PROGRAMS: tl.constexpr, GROUP_COLUMNS: tl.constexpr, FLATTEN: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, STORE_IN_PTX: tl.constexpr):
    row_tiles = tl.cdiv(num_rows, BLOCK_M)
    column_tiles = tl.cdiv(width, BLOCK_N)
    GROUPS: tl.constexpr = BLOCK_N // GROUP_COLUMNS
    PAIRS: tl.constexpr = GROUP_COLUMNS // 2
    # each pair's index and even column within a tile, in `_thread_groups` order, and its
    # hash's share (key + pair) · M1 = key · M1 + pair · M1, both loop invariant (the index is
    # linear: the product folds into one a thread plus a constant a pair)
    pair = tl.arange(0, PAIRS)[None, None, :]
    group = tl.arange(0, GROUPS)[None, :, None]
    even_column = top2_group_columns(group, 2 * pair, GROUP_COLUMNS)
    pair_share = top2_group_pairs(group, pair, GROUP_COLUMNS).to(tl.uint32) * _M1
    even_bit = 1 << (2 * pair)
    below_even = even_bit - 1
    below_odd = below_even | even_bit
    epilogue_tile = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), row_tiles * column_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        row_tile, column_tile = _tile_position(tile, row_tiles, column_tiles, GROUP_M)
        accumulator = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for step in range(0, hidden_size, BLOCK_K):
            a = hidden_desc.load([row_start + row_tile * BLOCK_M, step])
            b = weight_desc.load([column_tile * BLOCK_N, step])
            accumulator = tl.dot(a, b.T, accumulator, input_precision=DOT_PRECISION)
        epilogue_tile += NUM_PROGRAMS
        row_tile, column_tile = _tile_position(epilogue_tile, row_tiles, column_tiles, GROUP_M)
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            accumulator += tl.load(bias_ptr + columns, mask=columns < width, other=0.0).to(tl.float32)[None, :]
        z = tl.where(columns[None, :] < width, accumulator, float("-inf"))
        rows_ok = rows < num_rows
        row_offsets = rows.to(tl.int64)
        even, odd = tl.split(tl.reshape(_thread_groups(z, BLOCK_M, BLOCK_N, GROUP_COLUMNS),
                                        (BLOCK_M, GROUPS, PAIRS, 2)))
        # t = X · 2^MARGIN2 (X of the module docstring): the exponentials relative to the row's
        # floor less the margin, which is also the tiles' shift of their sums (no tile maximum);
        # rows past the chunk shift by +inf, so their t are 0 however large their logits
        shift2 = tl.load(floor_ptr + row_offsets, mask=rows_ok, other=float("inf")) * _LOG2E - _MARGIN2
        tl.store(tile_max2_ptr + row_offsets * column_tiles + column_tile, shift2, mask=rows_ok)
        t_even = tl.exp2(tl.fma(even, log2e_over_t, -shift2[:, None, None]))
        t_odd = tl.exp2(tl.fma(odd, log2e_over_t, -shift2[:, None, None]))
        tile_sum2 = tl.sum(tl.sum(t_even + t_odd, axis=2), axis=1)
        tl.store(tile_sum2_ptr + row_offsets * column_tiles + column_tile, tile_sum2, mask=rows_ok)
        # bound = 2^23 + X · 2^16; -1 (nothing kept) on rows past the chunk
        base = tl.where(rows_ok, _TWO_POW_23, -1.0)[:, None, None]
        tile_pair = ((noise_offset + column_tile * BLOCK_N) >> 1).to(tl.uint32)
        hash_base = ((row_key(seed_key, first_row + row_offsets) + tile_pair) * _M1)[:, None, None]
        bits = _kept_bits(tl.fma(t_even, _COARSE_SCALE, base), tl.fma(t_odd, _COARSE_SCALE, base), hash_base,
                          pair_share, even_bit)
        count = _popcount(bits, POPC_IN_HARDWARE)
        # a tile whose row sum passes 2^MAX_EXCESS2 (an element that far above the floor, or
        # past float32's range) counts past the capacity: the logits schedule redoes the row
        too_far = rows_ok & (tile_sum2 > _MAX_SUM2)
        row_count = tl.sum(count, axis=1) + tl.where(too_far, key_capacity + 1, 0)
        row_first = tl.atomic_add(counts_ptr + row_offsets, row_count, mask=row_count > 0, sem="relaxed")
        first = row_first[:, None] + tl.cumsum(count, axis=1) - count
        # a group whose slots would pass the capacity stores nothing (its row is redone)
        bits = tl.where(first + count <= key_capacity, bits, 0)
        column_even = noise_offset + column_tile * BLOCK_N + even_column
        _store_kept(even, even_bit, bits, below_even, first, column_even, row_offsets, keys_ptr, key_capacity,
                    STORE_IN_PTX)
        _store_kept(odd, even_bit << 1, bits, below_odd, first, column_even + 1, row_offsets, keys_ptr, key_capacity,
                    STORE_IN_PTX)


class SampleMatmul:
    """The sampling matmul of windows of rows of ``hidden [N, H]`` against ``weight [≥ width, H]``
    (bf16 / fp16; float32 with IEEE products under the interpreter, for the tests), bias
    ``[≥ width]`` or None. Its descriptors and tile statistics (for up to ``max_rows`` rows a
    window; None: N) are made once, so that a window's host work is one launch. A call
    appends into ``appends`` (`SampleAppends` of the window's rows) and returns the window's
    tile statistics ``(tile_max2, tile_sum2)`` ``[R, tiles]`` float32 (log2 units at τ: each
    tile's shift, here the row's floor less the margin, and its sum of
    ``2^(z · log2e / τ − shift)``; `tile_logsumexp` combines them; the same tensors from one
    call to the next: read them before the next call). The noise is that of global rows
    ``first_row + r`` and global columns ``noise_offset + c`` (``noise_offset`` even) under the
    32-bit ``seed_key`` (`kd_kernels.sampling.seed_key`)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias, width: int, temperature: float,
                 seed_key: int, noise_offset: int = 0, max_rows: int | None = None, config=None):
        config = config or default_config()
        if hidden.dtype == torch.float32 and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("hidden: the sampling matmul takes bf16 / fp16 on a GPU (float32 only under "
                             f"TRITON_INTERPRET=1, for the tests), got {hidden.dtype}")
        if noise_offset % 2:
            raise ValueError(f"noise_offset: the noise hashes pairs of columns from an even id, got {noise_offset}")
        if config.block_n % (4 * config.group_columns) or config.group_columns % 2:
            raise ValueError(f"config: an even group_columns whose 4 groups divide block_n, got "
                             f"{config.group_columns} and {config.block_n}")
        self.hidden, self.bias, self.width, self.config = hidden, bias, width, config
        self.log2e_over_t = math.log2(math.e) / temperature
        self.seed_key, self.noise_offset = signed_key(seed_key), noise_offset
        column_tiles = -(-width // config.block_n)
        max_rows = hidden.shape[0] if max_rows is None else max_rows
        self.tile_max2, self.tile_sum2 = empty_parts(hidden.device, ((max_rows, column_tiles), torch.float32),
                                                     ((max_rows, column_tiles), torch.float32))
        if hidden.shape[0] == 0:
            return
        user = "the teacher's sampling matmul"
        self.hidden_desc = row_tile_descriptor(hidden, "hidden", [config.block_m, config.block_k], user)
        self.weight_desc = row_tile_descriptor(weight, "weight", [config.block_n, config.block_k], user)
        self.multiprocessors = (multiprocessor_count(hidden.device)
                                if hidden.device.type == "cuda" else 3)  # the interpreter: several tiles a program

    def __call__(self, appends: SampleAppends, rows: slice = slice(None), first_row: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` of hidden (a slice, step 1; at most ``max_rows``), global rows
        ``first_row`` on, appended into ``appends`` -> their tile statistics."""
        config = self.config
        start, stop, step = rows.indices(self.hidden.shape[0])
        num_rows = max(0, stop - start)
        if step != 1 or num_rows > self.tile_max2.shape[0]:
            raise ValueError(f"rows: a slice of step 1 and at most {self.tile_max2.shape[0]} rows, got {rows}")
        _check_appends(appends, num_rows)
        tile_max2, tile_sum2 = self.tile_max2, self.tile_sum2
        if num_rows < tile_max2.shape[0]:  # no views where the window is the whole buffer (host time)
            tile_max2, tile_sum2 = tile_max2[:num_rows], tile_sum2[:num_rows]
        if num_rows == 0:
            return tile_max2, tile_sum2
        tiles = -(-num_rows // config.block_m) * self.tile_max2.shape[1]
        programs = min(tiles, self.multiprocessors)
        _lm_head_sample_kernel[(programs,)](
            self.hidden_desc, self.weight_desc, self.bias if self.bias is not None else tile_max2,
            tile_max2, tile_sum2, appends.floors, appends.keys, appends.counts, start, num_rows, self.width,
            self.noise_offset, self.hidden.shape[1], self.log2e_over_t, appends.keys.shape[1], self.seed_key,
            first_row, HAS_BIAS=self.bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, GROUP_M=config.group_m, NUM_PROGRAMS=programs,
            GROUP_COLUMNS=config.group_columns, FLATTEN=config.flatten, STORE_IN_PTX=STORE_IN_PTX,
            # float32 inputs get float32 products (tf32 would move logits by ~1e-3)
            DOT_PRECISION="ieee" if self.hidden.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages)
        return tile_max2, tile_sum2
