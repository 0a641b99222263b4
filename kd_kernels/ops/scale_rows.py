"""``out[r, :] = x[r, :] · scale[r]`` in float32 arithmetic, rounded once to out's dtype; out may
be x. Applies the per-row factor of the one-read gradient (see `row_statistics`) to dX and to
the hidden rows that meet it in dW."""
import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _scale_rows_kernel(x_ptr, scale_ptr, out_ptr, stride_x, stride_out, num_columns, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < num_columns
    scale = tl.load(scale_ptr + row)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=inside).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, (x * scale).to(out_ptr.dtype.element_ty), mask=inside)


def scale_rows(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x, out ``[R, C]`` (unit column stride, any float dtype), scale ``[R]`` float32. Returns out."""
    rows, num_columns = x.shape
    if rows and num_columns:
        _scale_rows_kernel[(rows, triton.cdiv(num_columns, BLOCK))](x, scale, out, x.stride(0), out.stride(0),
                                                                    num_columns, BLOCK=BLOCK, num_warps=4)
    return out
