"""Top-k of logits rows without ``torch.topk``: the Triton counterpart of the CUDA kernel
(csrc/topk_candidates.cu), for GPUs where the extension is not built.

Pass 1 (one program per row) streams the row in blocks of ``BLOCK_V`` columns, keeping the
logsumexp at τ and each lane's running maximum. The lane maxima are distinct elements, so
any T with at least k lane maxima ≥ T has at least k row elements ≥ T; a bisection finds
nearly the largest such T (T = -inf with fewer than k lanes). Pass 2 appends every element ≥ T
to a per-row buffer of ``capacity`` slots (an atomic slot each, in no order); one sort of a
(value, complemented column) key then gives the top-k with lower columns first among equal
values. Rows with more than ``capacity`` elements ≥ T
(heavy ties) are redone exactly with a full-row sort; finding them costs one host sync.
"""
import torch
import triton
import triton.language as tl

from .launch import ROW_BLOCK_V, THRESHOLD_BISECTIONS, num_warps_for
from .sort_keys import EMPTY_COLUMN, top_of_keys, value_column_keys
from .utils import LOG2E, kth_largest_lower_bound


@triton.jit
def _threshold_kernel(logits_ptr, lse_ptr, threshold_ptr, stride_row, width, k, log2e_over_t,
                      BLOCK_V: tl.constexpr, BISECTIONS: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    offsets = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)  # Σ 2^((z - lane_max) · log2e / τ)
    for start in range(0, width, BLOCK_V):
        cols = start + offsets
        z = tl.load(row_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, z)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp2((lane_max - safe_max) * log2e_over_t) + tl.exp2((z - safe_max) * log2e_over_t)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    safe_row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(lane_sum * tl.exp2((lane_max - safe_row_max) * log2e_over_t), axis=0)
    lse = (safe_row_max * log2e_over_t + tl.log2(total)) * 0.6931471805599453
    tl.store(lse_ptr + row, tl.where(row_max == float("-inf"), float("-inf"), lse))
    # largest T (to within bisection) with at least k lane maxima >= T; no sort needed
    lanes = lane_max > float("-inf")
    low = kth_largest_lower_bound(lane_max, lanes, k, BISECTIONS)
    enough_lanes = tl.sum(lanes.to(tl.int32), axis=0) >= k
    tl.store(threshold_ptr + row, tl.where(enough_lanes, low, float("-inf")))


@triton.jit
def _collect_kernel(logits_ptr, threshold_ptr, values_ptr, columns_ptr, counts_ptr, stride_row, width, capacity,
                    BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    out_values = values_ptr + row.to(tl.int64) * capacity
    out_columns = columns_ptr + row.to(tl.int64) * capacity
    counter = counts_ptr + row + tl.zeros([BLOCK_V], tl.int32)
    threshold = tl.load(threshold_ptr + row)
    offsets = tl.arange(0, BLOCK_V)
    for start in range(0, width, BLOCK_V):
        cols = start + offsets
        z = tl.load(row_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        take = (cols < width) & (z >= threshold)
        # a slot per taken element, in no particular order: one atomic each, so only the few taken
        # elements cost anything (a prefix sum would cost every block of every row)
        slots = tl.atomic_add(counter, 1, mask=take)
        keep = take & (slots < capacity)
        tl.store(out_values + slots, z, mask=keep)
        tl.store(out_columns + slots, cols, mask=keep)


def _capacity(k: int) -> int:
    return max(256, 4 * k)


def threshold_topk(logits: torch.Tensor, k: int, temperature: float, width: int):
    """logits ``[R, ≥ width]`` (columns contiguous) -> (values ``[R, k]`` float32 = top logits
    / τ, descending, lower column first on ties, -inf past ``width``; columns ``[R, k]``
    int64, 0 past ``width``; lse ``[R]`` float32 of ``logits[:, :width] / τ``)."""
    rows = logits.shape[0]
    device = logits.device
    capacity = _capacity(k)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    threshold = torch.empty(rows, dtype=torch.float32, device=device)
    found = torch.full((rows, capacity), -float("inf"), dtype=torch.float32, device=device)
    columns = torch.full((rows, capacity), EMPTY_COLUMN, dtype=torch.int32, device=device)
    counts = torch.zeros(rows, dtype=torch.int32, device=device)
    if rows:
        warps = num_warps_for(ROW_BLOCK_V)
        _threshold_kernel[(rows,)](logits, lse, threshold, logits.stride(0), width, k,
                                   LOG2E / temperature, BLOCK_V=ROW_BLOCK_V, BISECTIONS=THRESHOLD_BISECTIONS,
                                   num_warps=warps)
        _collect_kernel[(rows,)](logits, threshold, found, columns, counts, logits.stride(0), width, capacity,
                                 BLOCK_V=ROW_BLOCK_V, num_warps=warps)
    # value descending, the lower column first among equal values
    values, top_columns = top_of_keys(value_column_keys(found, columns), k)
    overflow = (counts > capacity).nonzero().flatten()
    if overflow.numel():  # heavy ties: the exact full-row sort for these rows only
        exact, exact_columns = torch.sort(logits[overflow, :width].float(), dim=-1, descending=True, stable=True)
        kept = min(k, width)
        values[overflow, :kept], top_columns[overflow, :kept] = exact[:, :kept], exact_columns[:, :kept]
    return values / temperature, top_columns, lse
