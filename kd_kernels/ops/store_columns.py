"""Scattered stores into a row-major matrix: ``out[r, columns[r, j] - column_start] = values[r, j]``
for the entries whose column lies in ``[column_start, column_end)``; the others are skipped.
Duplicate columns in a row must carry equal values (any of them may land). Rows flagged in
``clear`` are zeroed first (their dense part was dropped: see `gradient_plan`)."""
import torch
import triton
import triton.language as tl

CLEAR_BLOCK = 1024


@triton.jit
def _store_columns_kernel(out_ptr, columns_ptr, values_ptr, clear_ptr, stride_out, stride_columns, stride_values,
                          width, num_columns, column_start, column_end, HAS_CLEAR: tl.constexpr, BLOCK: tl.constexpr,
                          CLEAR_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    out_row = out_ptr + row.to(tl.int64) * stride_out
    if HAS_CLEAR:
        if tl.load(clear_ptr + row) != 0:
            clear_offsets = tl.arange(0, CLEAR_BLOCK)
            for start in range(0, num_columns, CLEAR_BLOCK):
                cols = start + clear_offsets
                tl.store(out_row + cols, tl.zeros([CLEAR_BLOCK], out_ptr.dtype.element_ty), mask=cols < num_columns)
            tl.debug_barrier()  # the zeros land before the columns below
    offsets = tl.arange(0, BLOCK)
    in_row = offsets < width
    columns = tl.load(columns_ptr + row.to(tl.int64) * stride_columns + offsets, mask=in_row, other=-1)
    values = tl.load(values_ptr + row.to(tl.int64) * stride_values + offsets, mask=in_row, other=0.0)
    inside = in_row & (columns >= column_start) & (columns < column_end)
    local = tl.where(inside, columns - column_start, 0)
    tl.store(out_row + local, values.to(out_ptr.dtype.element_ty), mask=inside)


def store_columns(out: torch.Tensor, columns: torch.Tensor, values: torch.Tensor, column_start: int = 0,
                  column_end=None, clear=None) -> torch.Tensor:
    """out ``[R, C]`` (unit column stride), columns ``[R, M]`` int64 global ids, values ``[R, M]``
    float32, clear ``[R]`` int8 or None."""
    rows, width = columns.shape
    column_end = out.shape[1] + column_start if column_end is None else column_end
    if rows and (width or clear is not None):
        _store_columns_kernel[(rows,)](out, columns, values, clear if clear is not None else columns, out.stride(0),
                                       columns.stride(0), values.stride(0), width, out.shape[1], column_start,
                                       column_end, HAS_CLEAR=clear is not None,
                                       BLOCK=triton.next_power_of_2(max(width, 1)), CLEAR_BLOCK=CLEAR_BLOCK,
                                       num_warps=4)
    return out
