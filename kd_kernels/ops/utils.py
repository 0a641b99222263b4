"""`@triton.jit` helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def logaddexp(a, b):
    """log(exp(a) + exp(b)), finite-safe when both are -inf (gives -inf)."""
    top = tl.maximum(a, b)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return safe + tl.log(tl.exp(a - safe) + tl.exp(b - safe))
