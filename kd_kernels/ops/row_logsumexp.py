"""Row statistics of a logits chunk in one streaming pass: logsumexp at temperature 1 and
at τ, and the argmax, over the columns that exist (``[0, vocab_size)``)."""
import torch
import triton
import triton.language as tl

from .launch import ROW_BLOCK_V, num_warps_for


@triton.jit
def _row_logsumexp_kernel(logits_ptr, bias_ptr, lse_ptr, lse_tempered_ptr, argmax_ptr,
                          stride_row, vocab_size, inv_temperature,
                          HAS_BIAS: tl.constexpr, TEMPERED: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    offsets = tl.arange(0, BLOCK_V)
    # Per-lane running max and sums; the temperature shares the max (τ > 0 keeps the order).
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_sum_tempered = tl.zeros([BLOCK_V], tl.float32)
    lane_arg = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offsets
        in_vocab = cols < vocab_size
        z = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        new_max = tl.maximum(lane_max, z)
        # A lane that has seen only -inf keeps max -inf: shift by 0 instead of NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(z - safe_max)
        if TEMPERED:
            lane_sum_tempered = (lane_sum_tempered * tl.exp((lane_max - safe_max) * inv_temperature)
                                 + tl.exp((z - safe_max) * inv_temperature))
        lane_arg = tl.where(z > lane_max, cols, lane_arg)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    # lower column wins ties: the smallest column among lanes holding the maximum
    best = tl.min(tl.where(lane_max == row_max, lane_arg, 2147483647), axis=0)
    total = tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0)
    tl.store(lse_ptr + row, row_max + tl.log(total))
    if TEMPERED:
        total_tempered = tl.sum(lane_sum_tempered * tl.exp((lane_max - row_max) * inv_temperature), axis=0)
        tl.store(lse_tempered_ptr + row, row_max * inv_temperature + tl.log(total_tempered))
    tl.store(argmax_ptr + row, best.to(tl.int64))


def row_logsumexp(logits: torch.Tensor, bias, vocab_size: int, temperature: float):
    """logits ``[R, C]`` (row stride any, columns contiguous), bias ``[C]`` or None.

    Returns float32 ``lse [R]`` = logsumexp(z[:, :V*]), ``lse_tempered [R]`` =
    logsumexp(z[:, :V*] / τ) (the same tensor when τ = 1) and int64 ``argmax [R]`` (lowest
    column on ties), z = logits + bias.
    """
    rows = logits.shape[0]
    tempered = temperature != 1.0
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse_tempered = torch.empty_like(lse) if tempered else lse
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _row_logsumexp_kernel[(rows,)](
            logits, bias if bias is not None else logits, lse, lse_tempered, argmax,
            logits.stride(0), vocab_size, 1.0 / temperature,
            HAS_BIAS=bias is not None, TEMPERED=tempered, BLOCK_V=ROW_BLOCK_V, num_warps=num_warps_for(ROW_BLOCK_V))
    return lse, lse_tempered, argmax
