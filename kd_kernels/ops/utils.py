"""`@triton.jit` helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def logaddexp(a, b):
    """log(exp(a) + exp(b)), finite-safe when both are -inf (gives -inf)."""
    top = tl.maximum(a, b)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return safe + tl.log(tl.exp(a - safe) + tl.exp(b - safe))


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
