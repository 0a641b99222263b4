"""Scattered stores into a row-major matrix: ``out[r, columns[r, j] - column_start] = values[r, j]``
for the entries whose column lies in ``[column_start, column_end)``; the others are skipped.
Duplicate columns in a row must carry equal values (any of them may land)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_columns_kernel(out_ptr, columns_ptr, values_ptr, stride_out, stride_columns, stride_values, width,
                          column_start, column_end, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    in_row = offsets < width
    columns = tl.load(columns_ptr + row.to(tl.int64) * stride_columns + offsets, mask=in_row, other=-1)
    values = tl.load(values_ptr + row.to(tl.int64) * stride_values + offsets, mask=in_row, other=0.0)
    inside = in_row & (columns >= column_start) & (columns < column_end)
    local = tl.where(inside, columns - column_start, 0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + local, values.to(out_ptr.dtype.element_ty), mask=inside)


def store_columns(out: torch.Tensor, columns: torch.Tensor, values: torch.Tensor, column_start: int = 0,
                  column_end=None) -> torch.Tensor:
    """out ``[R, C]`` (unit column stride), columns ``[R, M]`` int64 global ids, values ``[R, M]`` float32."""
    rows, width = columns.shape
    column_end = out.shape[1] + column_start if column_end is None else column_end
    if rows and width:
        _store_columns_kernel[(rows,)](out, columns, values, out.stride(0), columns.stride(0), values.stride(0), width,
                                       column_start, column_end, BLOCK=triton.next_power_of_2(width), num_warps=4)
    return out
