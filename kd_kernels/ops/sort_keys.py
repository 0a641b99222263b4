"""(value, column) pairs as one 64-bit key whose descending order is value descending, then
the lower column first: the float's bits made to order as a signed integer, above the
complemented column. One sort of keys replaces a two-key stable sort. The appending matmul
stores raw keys (a float's bits above its column, ops/lm_head_group_maxima.py), which the
per-row rankings (`top_of_counted_keys`) convert as they load them."""
import torch
import triton
import triton.language as tl

EMPTY_COLUMN = 2**31 - 1  # an empty slot: after every real column among equal (-inf) values
_EMPTY_COLUMN = tl.constexpr(EMPTY_COLUMN)  # the same, for kernels


def value_column_keys(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """float32 values and integer columns (same shape) -> int64 keys."""
    # + 0.0 turns -0.0 into 0.0: the two are equal values (a sort keeps their columns' order)
    bits = (values.contiguous() + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # signed order = float order
    return (ordered << 32) | (0xFFFFFFFF - columns.long())


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 keys -> (float32 values, int64 columns; EMPTY_COLUMN reads 0)."""
    ordered = (keys >> 32).to(torch.int32)
    values = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)
    columns = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
    return values, torch.where(columns == EMPTY_COLUMN, 0, columns)


def top_of_keys(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest keys of each row ``[R, C]`` in order, decoded: (values ``[R, k]``, columns)."""
    return decode_keys(torch.sort(keys, dim=-1, descending=True).values[:, :k])


# an empty slot's key (-inf at EMPTY_COLUMN: after every real entry), as a host scalar
EMPTY_KEY = value_column_keys(torch.tensor([float("-inf")]), torch.tensor([EMPTY_COLUMN])).item()


MAX_TRITON_SLOTS = 4096  # a row's keys in one program's registers: the extension's sort takes as many
SLOTS_A_WARP = 512  # the triton order's keys a warp: fewer warps make the bisection's reductions cheaper


def top_of_counted_keys(keys: torch.Tensor, counts: torch.Tensor, k: int, order: str,
                        smallest_band: int = SLOTS_A_WARP):
    """The k largest of each row's first ``counts [R]`` int32 raw keys (``keys [R, C]`` int64,
    contiguous, as the appending matmul stores them: a float's bits above its column,
    ops/topk_from_appended.py; the slots past a row's count are ignored), in the order of
    `value_column_keys` (value descending, then the lower column), decoded: (values ``[R, k]``
    float32, -inf past the count; columns ``[R, k]`` int32, 0 there). ``order``: "cuda" (a
    bitonic sort per row in the extension, C <= 4096) or "triton" (one program a row, C <=
    MAX_TRITON_SLOTS: the k-th key found by bisection, then a sort of k). The triton order ranks
    rows in bands of their filled slots (min(count, capacity), a negative count as 0), one
    launch a band: ``smallest_band`` (a power of two >= 2) slots, or k rounded up to a power of
    two where larger, or C rounded up where smaller, for the rows that fill at most that many,
    then twice as many for the next, up to C rounded up (a row of a few hundred keys in a
    2048-slot buffer is ranked by one warp, not four)."""
    if order not in ("cuda", "triton"):
        raise ValueError(f"order: expected 'cuda' or 'triton', got {order!r}")
    if smallest_band < 2 or smallest_band & (smallest_band - 1):
        raise ValueError(f"smallest_band: expected a power of two >= 2, got {smallest_band}")
    if order == "cuda":
        from .topk_candidates import load_extension

        return load_extension().sort_keys(keys, counts, k)
    rows, capacity = keys.shape
    if not 1 <= k <= capacity <= MAX_TRITON_SLOTS:
        raise ValueError(f"k, keys: the triton order takes 1 <= k <= slots a row <= {MAX_TRITON_SLOTS}; "
                         f"got k = {k}, {capacity} slots")
    if keys.dtype != torch.int64 or not keys.is_contiguous():
        raise ValueError(f"keys: expected contiguous int64, got {keys.dtype}, contiguous={keys.is_contiguous()}")
    values = torch.empty(rows, k, dtype=torch.float32, device=keys.device)
    columns = torch.empty(rows, k, dtype=torch.int32, device=keys.device)
    top = max(2, triton.next_power_of_2(k))
    slots, last = max(top, smallest_band), max(2, triton.next_power_of_2(capacity))
    below = -1  # the rows a band ranks fill more slots than this
    while rows and below < last:
        slots = min(slots, last)
        # the outputs hold the selected keys' two words between the kernel's two steps
        _select_then_sort_kernel[(rows,)](keys, counts, values, values.view(torch.int32), columns, capacity, k,
                                          EMPTY_KEY, below, SLOTS=slots, TOP=top,
                                          num_warps=max(1, min(8, slots // SLOTS_A_WARP)))
        below, slots = slots, 2 * slots
    return values, columns


@triton.jit
def _select_then_sort_kernel(keys, counts, values, value_words, columns, capacity, k, empty_key, below,
                             SLOTS: tl.constexpr, TOP: tl.constexpr):
    """One row a program, if it fills more than ``below`` and at most SLOTS slots (its band;
    other rows return at once): its first min(count, capacity) raw keys made `value_column_key`s
    (SLOTS, a power of two, with ``empty_key`` past them); the row's k-th largest key found by
    bisection over its two 32-bit words (each step a count over the row's keys: 32 steps, 64
    where values tie at the k-th); the k keys at or above it written compacted to the row's
    outputs (``value_words``: ``values`` as int32), read back as TOP (k rounded up to a power
    of two), sorted there and decoded."""
    row = tl.program_id(0).to(tl.int64)
    filled = tl.maximum(tl.minimum(tl.load(counts + row), capacity), 0)
    if (filled <= below) | (filled > SLOTS):
        return
    # empty slots take part (as empty_key): the k-th may be one where count < k
    key = _row_keys(keys, filled, row, capacity, empty_key, SLOTS)
    # both words as uint32 whose order is the key's: the high one signed, its sign bit flipped
    high = ((key >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True)
    low = key.to(tl.int32).to(tl.uint32, bitcast=True)
    high_kth = _kth_largest_word(high, high == high, k)
    above = high > high_kth
    tied = high == high_kth
    wanted = k - tl.sum(above.to(tl.int32), axis=0)  # taken from the tied keys, >= 1
    if tl.sum(tied.to(tl.int32), axis=0) > wanted:  # the value ties at the k-th: lower columns first
        low_kth = _kth_largest_word(low, tied, wanted)
        above = above | (tied & (low > low_kth))
        tied = tied & (low == low_kth)  # one key, or empty slots alike
        wanted = k - tl.sum(above.to(tl.int32), axis=0)
    selected = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= wanted))
    place = tl.cumsum(selected.to(tl.int32), axis=0) - 1
    selected = selected & (place < k)  # k selected at most by construction; the mask keeps stores in the row
    tl.store(value_words + row * k + place, (key >> 32).to(tl.int32), mask=selected)
    tl.store(columns + row * k + place, low.to(tl.int32), mask=selected)
    tl.debug_barrier()  # the block's stores seen by its loads
    rank = tl.arange(0, TOP)
    first = rank < k
    high_word = tl.load(value_words + row * k + rank, mask=first, other=0).to(tl.int64)
    low_word = tl.load(columns + row * k + rank, mask=first, other=0).to(tl.int64) & 0xFFFFFFFF
    top = tl.sort(tl.where(first, (high_word << 32) | low_word, empty_key), descending=True)
    tl.debug_barrier()  # every load done before the outputs are overwritten
    _store_top(values, columns, row, k, top, TOP)


@triton.jit
def _row_keys(keys, filled, row, capacity, empty_key, SLOTS: tl.constexpr):
    """Row ``row``'s first ``filled`` (<= SLOTS) raw keys (a float's bits above its column) as
    `value_column_key`s, ``empty_key`` in the other of its SLOTS."""
    slot = tl.arange(0, SLOTS)
    is_filled = slot < filled
    key = tl.load(keys + row * capacity + slot, mask=is_filled, other=0)
    key = key_of_raw(key)
    return tl.where(is_filled, key, empty_key)


@triton.jit
def _store_top(values, columns, row, k, top, TOP: tl.constexpr):
    """The first k of the TOP keys ``top`` (in order) decoded into row ``row`` of the outputs:
    values, and columns with 0 for an empty slot's."""
    rank = tl.arange(0, TOP)
    column = (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int32)
    tl.store(values + row * k + rank, value_of_key(top), mask=rank < k)
    tl.store(columns + row * k + rank, tl.where(column == _EMPTY_COLUMN, 0, column), mask=rank < k)


@triton.jit
def _kth_largest_word(words, counted, k):
    """The k-th largest of the uint32 ``words`` where ``counted``: the largest w with at least k
    counted words >= w, built from the top bit down, one count over the row a bit."""
    kth = tl.zeros((), tl.uint32)
    bit = tl.full((), 1 << 31, tl.uint32)
    for _ in range(32):
        trial = kth | bit
        enough = tl.sum((counted & (words >= trial)).to(tl.int32), axis=0) >= k
        kth = tl.where(enough, trial, kth)
        bit = bit >> 1
    return kth


@triton.jit
def ordered_bits(values):
    """float32 -> int32 whose signed order is the floats' order (NaN aside; -0.0 and 0.0 alike)."""
    bits = tl.where(values == 0.0, 0.0, values).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def value_column_key(values, columns):
    """`value_column_keys` inside a kernel."""
    return (ordered_bits(values).to(tl.int64) << 32) | (0xFFFFFFFF - columns.to(tl.int64))


@triton.jit
def key_of_raw(raw):
    """The appending matmul's raw int64 keys (a float's bits above its column) as `value_column_key`s."""
    return value_column_key((raw >> 32).to(tl.int32).to(tl.float32, bitcast=True), (raw & 0xFFFFFFFF).to(tl.int32))


@triton.jit
def value_of_key(keys):
    """The float32 value of int64 keys inside a kernel."""
    ordered = (keys >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
