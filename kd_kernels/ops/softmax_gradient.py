"""The dense part of the student's logit gradient, written in one streaming pass:
``grad = a · softmax(z) + b · softmax(z / τ)`` on the columns that exist, 0 past them.

The gradient may overwrite the logits it is computed from: a bf16/fp16 gradient row laid
over the first half of its own float32 logits row (row stride in bytes equal). Each step
stores only bytes that every thread of the program has already loaded (a barrier between
the load and the store), so one float32 buffer serves both.
"""
import torch
import triton
import triton.language as tl

from .launch import ROW_BLOCK_V, num_warps_for


@triton.jit
def _softmax_gradient_kernel(logits_ptr, bias_ptr, grad_ptr, lse_ptr, lse_tempered_ptr, coef_ptr, coef_tempered_ptr,
                             stride_logits, stride_grad, vocab_size, num_columns, inv_temperature,
                             HAS_BIAS: tl.constexpr, HAS_TEMPERED: tl.constexpr, IN_PLACE: tl.constexpr,
                             BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    logits_row = logits_ptr + row.to(tl.int64) * stride_logits
    grad_row = grad_ptr + row.to(tl.int64) * stride_grad
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    if HAS_TEMPERED:
        lse_tempered = tl.load(lse_tempered_ptr + row)
        coef_tempered = tl.load(coef_tempered_ptr + row)
    offsets = tl.arange(0, BLOCK_V)
    for start in range(0, num_columns, BLOCK_V):
        cols = start + offsets
        in_vocab = cols < vocab_size
        z = tl.load(logits_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        grad = coef * tl.exp(z - lse)
        if HAS_TEMPERED:
            grad += coef_tempered * tl.exp(z * inv_temperature - lse_tempered)
        grad = tl.where(in_vocab, grad, 0.0)
        if IN_PLACE:
            tl.debug_barrier()
        tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < num_columns)


def softmax_gradient(logits: torch.Tensor, bias, grad: torch.Tensor, lse: torch.Tensor, lse_tempered: torch.Tensor,
                     coef: torch.Tensor, coef_tempered, vocab_size: int, temperature: float) -> torch.Tensor:
    """Writes ``grad [R, C]`` (its dtype) from logits ``[R, C]`` (+ bias ``[C]``), float32 ``lse``,
    ``lse_tempered``, ``coef``, ``coef_tempered`` ``[R]`` (None: no tempered term). Returns grad.
    ``grad`` may alias ``logits`` (same storage and start, same row stride in bytes)."""
    rows, num_columns = logits.shape
    if rows:
        has_tempered = coef_tempered is not None
        _softmax_gradient_kernel[(rows,)](
            logits, bias if bias is not None else logits, grad, lse, lse_tempered, coef,
            coef_tempered if has_tempered else coef, logits.stride(0), grad.stride(0), vocab_size, num_columns,
            1.0 / temperature, HAS_BIAS=bias is not None, HAS_TEMPERED=has_tempered,
            IN_PLACE=grad.data_ptr() == logits.data_ptr(), BLOCK_V=ROW_BLOCK_V,
            num_warps=num_warps_for(ROW_BLOCK_V))
    return grad
