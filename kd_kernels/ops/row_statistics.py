"""Row statistics of logits rows in one streaming pass.

For columns ``[column_start, column_start + width)`` of each row (z = logits + bias; the whole
row, or this rank's shard of it): the logsumexp at temperature 1 and at τ, the maximum and its
column (lowest on ties), and the values at given global ids and at the label where these
columns hold them.

Optionally the same read also writes ``exp((z - shift) · w)`` over the row, in place (float32
over itself, or a bf16/fp16 row over the first half of its float32 row): the dense gradient up
to a per-row factor, so the gradient needs no second read of the logits (the factor
``coef · exp(shift · w − lse_w)`` is applied to dX and to the hidden rows of dW). ``shift``
starts at the largest of the gathered values (a lower bound of the row max, so no value
overflows) and moves up, rescaling what the row has written, only where the row climbs
``SHIFT_SLACK`` nats above it.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import ROW_BLOCK_V, num_warps_for, one_read_launch

# exp((z - shift) · w) stays below e^SHIFT_SLACK; above it the row's shift moves up (rare: the
# shift starts at the largest logit among the teacher ids and the label).
SHIFT_SLACK = 16.0


@dataclass
class RowStatistics:
    """Float32 ``lse``, ``lse_tempered`` (the same tensor when τ = 1), ``best`` (row max), int64
    ``top1``, float32 ``at_ids [N, k]`` and ``at_label [N]`` (None without ids / labels), float32
    ``shift [N]`` of the written exponentials (None unless they are written)."""

    lse: torch.Tensor
    lse_tempered: torch.Tensor
    best: torch.Tensor
    top1: torch.Tensor
    at_ids: Optional[torch.Tensor]
    at_label: Optional[torch.Tensor]
    shift: Optional[torch.Tensor] = None

    def rows(self, start: int, stop: int) -> "RowStatistics":
        """Views of rows [start, stop) (written in place by `row_statistics`)."""
        def part(t):
            return None if t is None else t[start:stop]
        return RowStatistics(part(self.lse), part(self.lse_tempered), part(self.best), part(self.top1),
                             part(self.at_ids), part(self.at_label), part(self.shift))

    @staticmethod
    def empty(num_rows: int, k: int, tempered: bool, labels: bool, device, shift: bool = False) -> "RowStatistics":
        lse = torch.full((num_rows,), -float("inf"), device=device)
        return RowStatistics(
            lse=lse, lse_tempered=lse.clone() if tempered else lse, best=lse.clone(),
            top1=torch.zeros(num_rows, dtype=torch.int64, device=device),
            at_ids=torch.zeros(num_rows, k, dtype=torch.float32, device=device) if k else None,
            at_label=torch.zeros(num_rows, dtype=torch.float32, device=device) if labels else None,
            shift=torch.zeros(num_rows, dtype=torch.float32, device=device) if shift else None)


@triton.jit
def _row_statistics_kernel(logits_ptr, bias_ptr, ids_ptr, labels_ptr,
                           lse_ptr, lse_tempered_ptr, best_ptr, top1_ptr, at_ids_ptr, at_label_ptr, exp_ptr,
                           shift_ptr, stride_row, stride_ids, stride_at_ids, stride_exp, width, num_columns,
                           column_start, k, inv_temperature, exp_weight,
                           HAS_BIAS: tl.constexpr, TEMPERED: tl.constexpr, HAS_IDS: tl.constexpr,
                           HAS_LABELS: tl.constexpr, WRITE_EXP: tl.constexpr, PLAIN_ONLINE: tl.constexpr,
                           TEMPERED_ONLINE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                           SLACK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    # the gathers come first: WRITE_EXP overwrites the row
    shift = tl.load(row_ptr, mask=width > 0, other=0.0).to(tl.float32)  # column 0: any value bounds the max
    if HAS_BIAS:
        shift += tl.load(bias_ptr, mask=width > 0, other=0.0).to(tl.float32)
    if HAS_IDS:
        k_offsets = tl.arange(0, BLOCK_K)
        in_k = k_offsets < k
        local = tl.load(ids_ptr + row.to(tl.int64) * stride_ids + k_offsets, mask=in_k, other=-1) - column_start
        owned = in_k & (local >= 0) & (local < width)
        values = tl.load(row_ptr + local, mask=owned, other=0.0).to(tl.float32)
        if HAS_BIAS:
            values += tl.load(bias_ptr + local, mask=owned, other=0.0).to(tl.float32)
        tl.store(at_ids_ptr + row.to(tl.int64) * stride_at_ids + k_offsets, values, mask=owned)
        shift = tl.maximum(shift, tl.max(tl.where(owned, values, float("-inf")), axis=0))
    if HAS_LABELS:
        local_label = tl.load(labels_ptr + row) - column_start
        label_owned = (local_label >= 0) & (local_label < width)
        label_value = tl.load(row_ptr + local_label, mask=label_owned, other=0.0).to(tl.float32)
        if HAS_BIAS:
            label_value += tl.load(bias_ptr + local_label, mask=label_owned, other=0.0).to(tl.float32)
        tl.store(at_label_ptr + row, label_value, mask=label_owned)
        shift = tl.maximum(shift, tl.where(label_owned, label_value, float("-inf")))
    if WRITE_EXP:
        tl.debug_barrier()
    exp_row = exp_ptr + row.to(tl.int64) * stride_exp
    offsets = tl.arange(0, BLOCK_V)
    # per-lane running max and sums; the temperature shares the max (τ > 0 keeps the order).
    # With WRITE_EXP the written values, summed, are one of the two sums (plain at w = 1, the
    # tempered one at w = 1 / τ): one exp per column where τ = 1. PLAIN_ONLINE /
    # TEMPERED_ONLINE: the sums still kept by the running max.
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_sum_tempered = tl.zeros([BLOCK_V], tl.float32)
    lane_sum_written = tl.zeros([BLOCK_V], tl.float32)  # Σ exp((z - shift) · w)
    lane_arg = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, num_columns if WRITE_EXP else width, BLOCK_V):
        cols = start + offsets
        inside = cols < width
        z = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if WRITE_EXP:
            block_max = tl.max(z, axis=0)
            if (block_max - shift) * exp_weight > SLACK:  # also where the shift is still -inf
                tl.debug_barrier()
                factor = tl.exp((shift - block_max) * exp_weight)
                for done in range(0, start, BLOCK_V):
                    done_cols = done + offsets
                    written = tl.load(exp_row + done_cols).to(tl.float32)
                    tl.store(exp_row + done_cols, (written * factor).to(exp_ptr.dtype.element_ty))
                lane_sum_written = lane_sum_written * factor
                shift = block_max
            value = tl.where(z > float("-inf"), tl.exp((z - shift) * exp_weight), 0.0)
            lane_sum_written += value
            tl.debug_barrier()  # every thread has loaded the bytes these stores overwrite
            tl.store(exp_row + cols, value.to(exp_ptr.dtype.element_ty), mask=cols < num_columns)
        new_max = tl.maximum(lane_max, z)
        if PLAIN_ONLINE or TEMPERED_ONLINE:
            # a lane that has seen only -inf keeps max -inf: shift by 0 instead of NaN
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            if PLAIN_ONLINE:
                lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(z - safe_max)
            if TEMPERED_ONLINE:
                lane_sum_tempered = (lane_sum_tempered * tl.exp((lane_max - safe_max) * inv_temperature)
                                     + tl.exp((z - safe_max) * inv_temperature))
        lane_arg = tl.where(z > lane_max, cols, lane_arg)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    # the lowest column among lanes holding the maximum
    arg = tl.min(tl.where(lane_max == row_max, lane_arg, 2147483647), axis=0).to(tl.int64) + column_start
    safe_row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    if PLAIN_ONLINE:
        lse = safe_row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - safe_row_max), axis=0))
    else:
        lse = shift + tl.log(tl.sum(lane_sum_written, axis=0))
    if TEMPERED:
        if TEMPERED_ONLINE:
            lse_tempered = safe_row_max * inv_temperature + tl.log(
                tl.sum(lane_sum_tempered * tl.exp((lane_max - safe_row_max) * inv_temperature), axis=0))
        else:
            lse_tempered = shift * exp_weight + tl.log(tl.sum(lane_sum_written, axis=0))
    tl.store(lse_ptr + row, lse)
    if TEMPERED:
        tl.store(lse_tempered_ptr + row, lse_tempered)
    tl.store(best_ptr + row, row_max)
    tl.store(top1_ptr + row, arg)
    if WRITE_EXP:
        tl.store(shift_ptr + row, shift)


def row_statistics(logits: torch.Tensor, bias, width: int, temperature: float, out: RowStatistics,
                   ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                   column_start: int = 0, exp_out: Optional[torch.Tensor] = None,
                   exp_weight: float = 1.0) -> RowStatistics:
    """logits ``[R, ≥width]`` (unit column stride) of global columns ``[column_start, +width)``,
    bias ``[width]`` or None; ids ``[R, k]`` / labels ``[R]`` int64 global columns (already
    safe: no -1 / ignore_index). Writes and returns ``out`` (``RowStatistics.empty``): ids
    and labels outside these columns keep its initial values.

    ``exp_out`` ``[R, C]`` (C = logits.shape[1]; any float dtype, may alias logits: same storage
    and start, same row stride in bytes): also written, ``exp((z - out.shift) · exp_weight)`` on the
    ``width`` existing columns and 0 past them (``out`` made with ``shift=True``)."""
    rows, num_columns = logits.shape
    tempered = temperature != 1.0
    k = 0 if ids is None else ids.shape[1]
    write_exp = exp_out is not None
    if write_exp and out.shift is None:
        raise ValueError("row_statistics: exp_out needs out.shift (RowStatistics.empty(..., shift=True))")
    if write_exp and exp_weight not in (1.0, 1.0 / temperature):
        raise ValueError(f"row_statistics: exp_weight: expected 1 or 1 / temperature, got {exp_weight!r}")
    # w = 1 / τ (τ ≠ 1): the written values sum to the tempered logsumexp, else to the plain one
    exp_tempered = write_exp and tempered and exp_weight != 1.0
    block, warps = one_read_launch(rows) if write_exp else (ROW_BLOCK_V, num_warps_for(ROW_BLOCK_V))
    if rows:
        _row_statistics_kernel[(rows,)](
            logits, bias if bias is not None else logits, ids if ids is not None else out.top1,
            labels if labels is not None else out.top1,
            out.lse, out.lse_tempered, out.best, out.top1,
            out.at_ids if out.at_ids is not None else out.lse,
            out.at_label if out.at_label is not None else out.lse,
            exp_out if write_exp else logits, out.shift if write_exp else out.lse,
            logits.stride(0), ids.stride(0) if ids is not None else 0,
            out.at_ids.stride(0) if out.at_ids is not None else 0, exp_out.stride(0) if write_exp else 0, width,
            num_columns, column_start, k, 1.0 / temperature, float(exp_weight), HAS_BIAS=bias is not None,
            TEMPERED=tempered, HAS_IDS=ids is not None, HAS_LABELS=labels is not None, WRITE_EXP=write_exp,
            PLAIN_ONLINE=not write_exp or exp_tempered, TEMPERED_ONLINE=tempered and not exp_tempered,
            BLOCK_V=block, BLOCK_K=triton.next_power_of_2(max(k, 1)), SLACK=SHIFT_SLACK, num_warps=warps)
    return out
