"""The sparse columns of the student's logit gradient, one program per row: for each teacher id
(and the label) its column and full gradient value, the dense part ``coef · softmax(z) +
coef_tempered · softmax(z / τ)`` at that column plus every sparse term landing on it, so that
duplicate columns (invalid entries' id 0, the label among the ids) carry equal values and
`store_columns` may write them in any order. One kernel instead of a chain of small torch
ops per chunk (each a launch and a gap on the device).

With a ``shift`` (the row holds ``exp((z - shift) · w)``, not the dense gradient: see
`row_statistics`), the row's factor ``scale = coef_w · exp(shift · w - lse_w)`` is returned
too and the values are divided by it; rows whose factor is 0 (nothing dense: the row is to be
cleared) get factor 1."""
from typing import Optional

import torch
import triton
import triton.language as tl

# Below this the row's dense part (at most TINY_SCALE · e^SHIFT_SLACK per entry) is dropped and
# the row cleared: the values divided by the factor stay far inside the bf16 / fp32 range.
TINY_SCALE = tl.constexpr(1e-30)


@triton.jit
def _gradient_plan_kernel(teacher_ptr, grad_ids_ptr, ids_ptr, at_ids_ptr, lse_ptr, lse_tempered_ptr, coef_ptr,
                          coef_tempered_ptr, labels_ptr, at_label_ptr, label_grad_ptr, columns_ptr, values_ptr,
                          shift_ptr, shift_coef_ptr, shift_lse_ptr, row_scale_ptr, clear_ptr,
                          k, stride_teacher, stride_grad, stride_ids, stride_at_ids, stride_out, inv_temperature,
                          exp_weight, HAS_TEMPERED: tl.constexpr, HAS_LABEL: tl.constexpr,
                          HAS_SHIFT: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_K)
    in_k = offsets < k
    teacher = tl.load(teacher_ptr + row * stride_teacher + offsets, mask=in_k, other=float("-inf")).to(tl.float32)
    valid = in_k & (teacher > float("-inf")) & (teacher < float("inf"))  # isfinite: NaN fails both
    grad = tl.where(valid, tl.load(grad_ids_ptr + row * stride_grad + offsets, mask=in_k, other=0.0), 0.0)
    ids = tl.load(ids_ptr + row * stride_ids + offsets, mask=in_k, other=-1)
    # invalid entries point at column 0: each carries everything that lands there
    at_column0 = tl.sum(tl.where(ids == 0, grad, 0.0), axis=0)
    sparse = tl.where(valid, grad, at_column0)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    z = tl.load(at_ids_ptr + row * stride_at_ids + offsets, mask=in_k, other=0.0)
    dense = coef * tl.exp(z - lse)
    if HAS_TEMPERED:
        lse_tempered = tl.load(lse_tempered_ptr + row)
        coef_tempered = tl.load(coef_tempered_ptr + row)
        dense += coef_tempered * tl.exp(z * inv_temperature - lse_tempered)
    if HAS_LABEL:
        label = tl.load(labels_ptr + row)
        label_grad = tl.load(label_grad_ptr + row)
        on_label = ids == label
        sparse += tl.where(on_label, label_grad, 0.0)
        ids_on_label = tl.sum(tl.where(valid & on_label, grad, 0.0), axis=0)
        z_label = tl.load(at_label_ptr + row)
        dense_label = coef * tl.exp(z_label - lse)
        if HAS_TEMPERED:
            dense_label += coef_tempered * tl.exp(z_label * inv_temperature - lse_tempered)
        label_value = dense_label + (ids_on_label + label_grad)
    row_scale = 1.0
    if HAS_SHIFT:
        shift = tl.load(shift_ptr + row)
        scale = tl.load(shift_coef_ptr + row) * tl.exp(shift * exp_weight - tl.load(shift_lse_ptr + row))
        clear = tl.abs(scale) < TINY_SCALE  # NaN is kept: it shows in the gradient
        row_scale = tl.where(clear, 1.0, scale)
        tl.store(row_scale_ptr + row, row_scale)
        tl.store(clear_ptr + row, clear.to(tl.int8))
    if HAS_LABEL:
        tl.store(values_ptr + row * stride_out + k, label_value / row_scale)
        tl.store(columns_ptr + row * stride_out + k, label)
    tl.store(values_ptr + row * stride_out + offsets, (dense + sparse) / row_scale, mask=in_k)
    tl.store(columns_ptr + row * stride_out + offsets, ids, mask=in_k)


def gradient_plan(teacher_logprobs: torch.Tensor, grad_ids: torch.Tensor, ids: torch.Tensor, at_ids: torch.Tensor,
                  lse: torch.Tensor, lse_tempered: torch.Tensor, coef: torch.Tensor,
                  coef_tempered: Optional[torch.Tensor], labels: Optional[torch.Tensor],
                  at_label: Optional[torch.Tensor], label_grad: Optional[torch.Tensor], temperature: float,
                  shift: Optional[torch.Tensor] = None, exp_weight: float = 1.0):
    """Columns ``[R, M]`` int64 and float32 values ``[R, M]`` (M = k, + 1 with labels); with a
    ``shift``, also the float32 row factors ``[R]`` and int8 rows to clear ``[R]``.

    teacher_logprobs ``[R, k]`` (its finite entries are the valid ones); grad_ids ``[R, k]``
    float32 d objective / d logit at each id; ids ``[R, k]`` int64 (invalid -> 0); at_ids
    ``[R, k]`` float32 raw logits there; lse / lse_tempered / coef / coef_tempered ``[R]``
    float32 (coef_tempered None: no tempered term); labels ``[R]`` int64 (ignored -> 0),
    at_label and label_grad ``[R]`` float32, all three None without labels. Rows ``[R, k]`` need
    unit column stride. shift ``[R]`` float32 with ``exp_weight`` 1 (the dense part is coef's
    alone: coef_tempered None) or 1 / τ (coef's is zero: the dense part is coef_tempered's)."""
    rows, k = ids.shape
    width = k + (labels is not None)
    has_shift = shift is not None
    if has_shift and exp_weight == 1.0 and coef_tempered is not None:
        raise ValueError("gradient_plan: a shift with exp_weight 1 needs coef_tempered None (one dense term)")
    # per-row vectors may arrive as strided views (a column of the ranks' summed statistics)
    lse, lse_tempered, coef, coef_tempered, labels, at_label, label_grad, shift = (
        None if t is None else t.contiguous()
        for t in (lse, lse_tempered, coef, coef_tempered, labels, at_label, label_grad, shift))
    columns = torch.empty(rows, width, dtype=torch.int64, device=ids.device)
    values = torch.empty(rows, width, dtype=torch.float32, device=ids.device)
    row_scale = torch.empty(rows, dtype=torch.float32, device=ids.device) if has_shift else None
    clear = torch.empty(rows, dtype=torch.int8, device=ids.device) if has_shift else None
    if rows:
        has_tempered, has_label = coef_tempered is not None, labels is not None
        # w = 1 / τ: coef is zero (no CE); without a tempered term either, every row is cleared
        dense_is_tempered = exp_weight != 1.0 and has_tempered
        shift_coef, shift_lse = (coef_tempered, lse_tempered) if dense_is_tempered else (coef, lse)
        _gradient_plan_kernel[(rows,)](
            teacher_logprobs, grad_ids, ids, at_ids, lse, lse_tempered, coef,
            coef_tempered if has_tempered else coef, labels if has_label else ids,
            at_label if has_label else lse, label_grad if has_label else lse, columns, values,
            shift if has_shift else lse, shift_coef if has_shift else lse, shift_lse if has_shift else lse,
            row_scale if has_shift else lse, clear if has_shift else ids,
            k, teacher_logprobs.stride(0), grad_ids.stride(0), ids.stride(0), at_ids.stride(0), width,
            1.0 / temperature, float(exp_weight), HAS_TEMPERED=has_tempered, HAS_LABEL=has_label,
            HAS_SHIFT=has_shift, BLOCK_K=triton.next_power_of_2(k), num_warps=4 if k <= 256 else 8)
    if has_shift:
        return columns, values, row_scale, clear
    return columns, values
