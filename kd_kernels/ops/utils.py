"""`@triton.jit` helpers shared by the kernels, and the constant their launchers scale by."""
import math

import triton
import triton.language as tl

LOG2E = math.log2(math.e)  # the kernels take exp and log in base 2: z · log2e / τ


@triton.jit
def logaddexp(a, b):
    """log(exp(a) + exp(b)), finite-safe when both are -inf (gives -inf)."""
    top = tl.maximum(a, b)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return safe + tl.log(tl.exp(a - safe) + tl.exp(b - safe))


@triton.jit
def kth_largest_by_removal(values, valid, k):
    """A lower bound of the k-th largest valid value of ``values`` (1-D float32): the largest
    value left after k − 1 times removing the largest with every value equal to it (tied values
    leave together, so it is at or below the k-th largest); -inf where fewer than k valid values
    differ. One maximum a rank: fewer reductions than a bisection where k is small."""
    left = tl.where(valid, values, float("-inf"))
    top = tl.max(left, axis=0)
    for _ in range(1, k):
        left = tl.where(left >= top, float("-inf"), left)
        top = tl.max(left, axis=0)
    return top


@triton.jit
def kth_largest_lower_bound(values, valid, k, STEPS: tl.constexpr):
    """A lower bound of the k-th largest valid value of ``values`` (1-D float32), from STEPS
    value-space bisection steps between the smallest and the largest valid one, each keeping at
    least k valid values at or above the bound: within (largest − smallest) / 2^STEPS below the
    k-th largest. Where fewer than k are valid, the smallest valid value (+inf where none is):
    callers check the count themselves."""
    counted = tl.where(valid, values, float("-inf"))  # never reaches a finite middle: no mask in the loop
    low = tl.min(tl.where(valid, values, float("inf")), axis=0)
    high = tl.max(counted, axis=0)
    for _ in range(STEPS):
        middle = low + (high - low) * 0.5
        enough = tl.sum((counted >= middle).to(tl.int32), axis=0) >= k
        low = tl.where(enough, middle, low)
        high = tl.where(enough, high, middle)
    return low


@triton.jit
def row_logsumexp(tile_max2_ptr, tile_sum2_ptr, lse_ptr, row, tiles, TILES: tl.constexpr):
    """The row's logsumexp at τ (natural units) stored from its tiles' (max, sum of exp) in
    log2 units; returns the tile maxima ``[TILES]`` (-inf past ``tiles``)."""
    t = tl.arange(0, TILES)
    tile_max2 = tl.load(tile_max2_ptr + row * tiles + t, mask=t < tiles, other=float("-inf"))
    tile_sum2 = tl.load(tile_sum2_ptr + row * tiles + t, mask=t < tiles, other=0.0)
    row_max2 = tl.max(tile_max2, axis=0)
    safe_max2 = tl.where(row_max2 == float("-inf"), 0.0, row_max2)
    total = tl.sum(tile_sum2 * tl.exp2(tile_max2 - safe_max2), axis=0)
    tl.store(lse_ptr + row, tl.where(row_max2 == float("-inf"), float("-inf"),
                                     (safe_max2 + tl.log2(total)) * 0.6931471805599453))
    return tile_max2
