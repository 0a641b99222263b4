"""The Triton per-row top-k of counted raw keys (kd_kernels/ops/sort_keys.py, order "triton":
the appended schedule's ranking on the triton backend) against a plain stable sort: ties at
the k-th value, -0.0 beside 0.0, empty rows, counts past the capacity; and its input checks.
The CUDA sort's twin test is in tests/test_teacher_topk_cuda.py."""
import pytest
import torch
import triton

from helpers import HAS_CUDA, check_counted_top, counted_keys_case
from kd_kernels.ops.sort_keys import MAX_TRITON_SLOTS, SLOTS_A_WARP, top_of_counted_keys

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"
# the interpreter runs a 4096-slot row in seconds: the largest shapes on the GPU only
SHAPES = [(8, 1), (100, 60), (300, 300), (512, 7)] + ([(4096, 1024), (2048, 1024), (4096, 2500), (2048, 17)]
                                                      if HAS_CUDA else [])


@pytest.mark.parametrize("capacity, k", SHAPES)
@pytest.mark.parametrize("rounded", [True, False])
@pytest.mark.parametrize("smallest_band", [SLOTS_A_WARP, 2])
def test_the_triton_order_ranks_each_rows_counted_keys(capacity, k, rounded, smallest_band):
    """Every row ranked by its band's launch (the smallest band of 2: a band from k on)."""
    # a row on each side of every edge between two bands (bands from k rounded up on), one
    # negative count (read as 0), after the case's rows 0-3 (count 0, full, past full, ties)
    first_band = max(triton.next_power_of_2(k), smallest_band)
    edges = [e for band in (first_band << i for i in range(13)) if band < capacity for e in (band, band + 1)]
    keys, counts, values, columns = counted_keys_case(capacity, k, rounded, rows=(64 if HAS_CUDA else 5) + len(edges),
                                                      device=DEVICE)
    counts[4:4 + len(edges)] = torch.tensor(edges, dtype=torch.int32)
    counts[-1] = -1
    got_values, got_columns = top_of_counted_keys(keys, counts, k, "triton", smallest_band)
    check_counted_top(got_values, got_columns, values, columns, counts, k)


def test_the_triton_order_refuses_what_it_cannot_rank():
    keys = torch.zeros(2, 8, dtype=torch.int64, device=DEVICE)
    counts = torch.full((2,), 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"k, keys: the triton order takes 1 <= k <= slots a row <= 4096; got k = 9"):
        top_of_counted_keys(keys, counts, 9, "triton")
    wide = torch.zeros(1, MAX_TRITON_SLOTS + 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="4097 slots"):
        top_of_counted_keys(wide, counts[:1], 4, "triton")
    with pytest.raises(ValueError, match="keys: expected contiguous int64, got torch.int32"):
        top_of_counted_keys(keys.int(), counts, 4, "triton")
    with pytest.raises(ValueError, match="order: expected 'cuda' or 'triton', got 'torch'"):
        top_of_counted_keys(keys, counts, 4, "torch")
    with pytest.raises(ValueError, match="smallest_band: expected a power of two >= 2, got 24"):
        top_of_counted_keys(keys, counts, 4, "triton", 24)
