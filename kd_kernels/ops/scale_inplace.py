"""``x *= scale`` in place, where ``scale`` is a device scalar; nothing is read or written
when it is exactly 1 (the usual upstream gradient), without a host sync to find that out."""
import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _scale_inplace_kernel(x_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(x_ptr + offsets, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


def scale_inplace(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: any contiguous float tensor; scale: a one-element tensor on x's device. Returns x."""
    numel = x.numel()
    if numel:
        _scale_inplace_kernel[(triton.cdiv(numel, BLOCK),)](x, scale, numel, BLOCK=BLOCK, num_warps=8)
    return x
