"""The teacher's Gumbel noise inside kernels: the same bits as `kd_kernels.sampling.noise_bits`
(its module docstring defines them), in uint32 arithmetic.

The epilogue of the sampling matmul computes one `pair_hash` a pair of columns and only its
"coarse" 16 bits a column (`coarse_floats`); the exact noise (`gumbel_of_pair`) is computed
only for the few elements it keeps. Float steps that must agree between kernels are written as
explicit fma (no contraction left to the compiler). Where a bound suffices (the floors), the
coarse bits give one (`coarse_gumbel_lower_bound`) at a fraction of the exact noise's work.
"""
import torch
import triton
import triton.language as tl

from ..sampling import FINE_SALT, HASH_M1, HASH_M2

_M1 = tl.constexpr(HASH_M1)
_M2 = tl.constexpr(HASH_M2)
_FINE_SALT = tl.constexpr(FINE_SALT)
# 2^23 as float bits: OR-ing 16 bits into the mantissa gives the float 2^23 + m exactly
_TWO_POW_23_BITS = tl.constexpr(0x4B000000)


def signed_key(key: int) -> int:
    """A 32-bit key as the int32 a kernel argument holds (kernels bitcast it back to uint32)."""
    return key - (1 << 32) if key >= 1 << 31 else key


@triton.jit
def pair_mix(x):
    """lowbias32 without its first xorshift, on uint32."""
    x = x * _M1
    x = x ^ (x >> 15)
    x = x * _M2
    return x ^ (x >> 16)


@triton.jit
def mix32(x):
    """lowbias32 on uint32."""
    return pair_mix(x ^ (x >> 16))


@triton.jit
def row_key(seed_key, row):
    """uint32 key of global row ``row`` (int64, ≥ 0) under the int32-held ``seed_key``."""
    low = (row & 0xFFFFFFFF).to(tl.uint32)
    high = (row >> 32).to(tl.uint32)
    return mix32(mix32(seed_key.to(tl.uint32, bitcast=True) ^ low) + high)


@triton.jit
def pair_hash(key, column):
    """uint32 hash of the column pair holding ``column`` (int32 / int64 global id ≥ 0)."""
    return pair_mix(key + (column >> 1).to(tl.uint32))


@triton.jit
def coarse_floats(h):
    """(even, odd) floats ``2^23 + coarse`` of a pair hash: the high 16 bits for the pair's
    even column, the low 16 for its odd one."""
    even = ((h >> 16) | _TWO_POW_23_BITS).to(tl.float32, bitcast=True)
    odd = ((h & 0xFFFF) | _TWO_POW_23_BITS).to(tl.float32, bitcast=True)
    return even, odd


@triton.jit
def gumbel_of_pair(h, odd):
    """The standard Gumbel noise float32 of the column of parity ``odd`` (int32 0 / 1) whose pair
    hash is ``h``: ``−log(E)``, ``E = −log1p(−w)``, ``w = (m + ½) · 2⁻³²``, E to a few ulps: by its
    series for w < 1/32, by ``−log(u) · w / (1 − u)`` with ``u = 1 − w`` rounded (Goldberg's log1p)
    for w < 1/2, by ``−log(u)`` with u from the complement of m's bits above."""
    odd32 = odd.to(tl.uint32)
    coarse = tl.where(odd32 == 1, h & 0xFFFF, h >> 16)
    m = (coarse << 16) | (mix32(h ^ (_FINE_SALT + odd32)) >> 16)
    w = (m.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    series = tl.fma(w, 0.2, 0.25)
    series = tl.fma(w, series, 0.3333333432674408)
    series = tl.fma(w, series, 0.5)
    series = tl.fma(w, series, 1.0) * w
    u = 1.0 - w
    middle = -tl.log(u) * (w / (1.0 - u))
    upper = -tl.log(((m ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10)
    exponential = tl.where(m < 0x08000000, series, tl.where(m < 0x80000000, middle, upper))
    return -tl.log(exponential)


@triton.jit
def coarse_gumbel_lower_bound(key, column):
    """A lower bound float32 of the Gumbel noise of global ``column`` in the row of uint32 ``key``
    from its coarse 16 bits c alone (one hash, two fast logs): ``w < (c + 1) · 2⁻¹⁶`` bounds
    ``E = −log1p(−w)`` above and so ``G = −log(E)`` below, to the fast logs' error (~1e-6
    relative) and within ~2⁻¹⁶ / E of G; never under G's least value −log(33 · ln 2) ≈ −3.13
    (−3.2 where c = 2¹⁶ − 1 bounds nothing)."""
    h = pair_hash(key, column)
    coarse = tl.where((column & 1) == 1, h & 0xFFFF, h >> 16)
    x = (coarse.to(tl.float32) + 1.0) * 1.52587890625e-05  # (c + 1) · 2⁻¹⁶; 1 − x is exact
    series = x * tl.fma(x, tl.fma(x, tl.fma(x, 0.25, 0.3333333432674408), 0.5), 1.0)
    exponential = tl.where(x < 0.03125, series, -tl.log2(1.0 - x) * 0.6931471805599453)
    return tl.maximum(-tl.log2(exponential) * 0.6931471805599453, -3.2)


@triton.jit
def gumbel_noise(key, column):
    """Gumbel noise float32 of global ``column`` (int32 / int64) in the row of uint32 ``key``."""
    return gumbel_of_pair(pair_hash(key, column), (column & 1).to(tl.int32))


@triton.jit
def global_row(rows_ptr, first_row, row, ROWS_LISTED: tl.constexpr):
    """Row ``row``'s global index (int64): ``rows_ptr[row]`` if listed, else ``first_row + row``."""
    index = first_row + row
    if ROWS_LISTED:
        index = tl.load(rows_ptr + row)
    return index


@triton.jit
def noisy_raw_keys(raw, inv_t, key):
    """Raw keys (a logit's float bits above its column, int64) of the row of uint32 ``key`` made
    noisy -> (``κ = fma(z, 1/τ, G)``'s bits above the column, κ float32)."""
    z = (raw >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    column = (raw & 0xFFFFFFFF).to(tl.int32)
    kappa = tl.fma(z, inv_t, gumbel_noise(key, column))
    return (kappa.to(tl.int32, bitcast=True).to(tl.int64) << 32) | column.to(tl.int64), kappa


def row_operands(global_rows, stand_in: torch.Tensor) -> tuple:
    """The kernels' (rows pointer, first row, ROWS_LISTED) for ``global_rows``: an int, the
    global index of the first of consecutive rows (no index tensor to build and slice on the
    host), or ``[R]`` int64 global indices (``stand_in`` fills the unused operand)."""
    if isinstance(global_rows, torch.Tensor):
        if global_rows.dim() != 1 or global_rows.dtype != torch.int64:
            raise ValueError(f"global_rows: expected [R] int64 row indices (or an int, the first row's), got "
                             f"{global_rows.dtype} of shape {list(global_rows.shape)}")
        return global_rows, 0, True
    if isinstance(global_rows, bool) or not isinstance(global_rows, int):
        raise TypeError(f"global_rows: expected an int (the first row's index) or [R] int64, got "
                        f"{type(global_rows).__name__}")
    return stand_in, global_rows, False
