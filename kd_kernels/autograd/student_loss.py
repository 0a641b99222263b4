"""Autograd of the fused student loss: top-k divergence + CE through the lm_head.

Design:
- Fast schedule: rows are processed in chunks of ``chunk_rows``. For each chunk one cuBLAS
  matmul writes float32 logits ``[C, V]`` (bf16 inputs, fp32 accumulator and output:
  bf16-rounded logits would move probabilities by several percent), one Triton pass takes
  each row's two logsumexps, argmax and the values at the teacher ids and label, and the
  O(C·k) loss math with its closed-form gradient runs in one Triton program per row.
- For reduction "mean"/"sum" the gradient is produced in the same chunk pass (3 matmuls in
  all): a Triton pass writes ``dlogits = a·softmax(z) + b·softmax(z/τ)`` in the input
  dtype over the float32 logits it reads (same buffer), the k + 1 sparse columns are
  stored on top, then ``dX = dlogits @ W`` and ``dW += dlogitsᵀ @ X``. Backward only
  scales them by the upstream gradient (skipped on the device when it is 1).
- One read (the default where the dense gradient has one term: not both CE and the tail
  mode at τ ≠ 1; bf16 / fp32 rows): the statistics pass itself writes
  ``e = exp((z - shift) · w)`` over the row, so the gradient pass, which read every float32
  logit a second time, is gone. The gradient is ``diag(s) · e'`` (e' = e with the sparse
  columns stored as value / s; s = coef · exp(shift · w - lse_w) per row, known after the
  loss math), so ``dX = diag(s) (e' @ W)`` and ``dW += e'ᵀ @ (diag(s) X)``: two O(R·H)
  scalings instead of an O(R·V) pass. Two dense terms, or fp16 rows, take the two passes.
- For reduction "none" the upstream gradient is per row, so backward recomputes the chunks.
- Lean schedule (``lean=True``): the same passes in short chunks whose float32 logits stay
  under ``LEAN_CHUNK_BYTES`` (384 rows at V = 151,936): ≤ 256 MiB whatever N, for one
  extra read-modify-write of dW (bf16) per chunk.
- Vocab parallel (a `VocabShard`): the same passes over this rank's columns, statistics
  combined over the group before the loss math, dX summed over the group.
Memory beyond inputs and outputs: ``chunk_rows · V · 4`` bytes plus O(N·k) (fast schedule).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..lm_head import lm_head_logits_fp32 as _lm_head_logits_fp32
from ..options import DivergenceOptions
from ..support import SupportGradients, StudentRowStats, counted_rows, row_metrics
from ..topk import TopK

_METRIC_NAMES = ("kd_sum", "ce_sum", "teacher_mass_sum", "student_mass_sum", "top1_agreement_sum", "rows")
# The float32 logits chunk (which the gradient then overwrites) stays under this many bytes.
DEFAULT_CHUNK_BYTES = 5 << 28  # 1.25 GiB: 2048 rows at V = 151,936
CHUNK_ROW_MULTIPLE = 128
# The lean schedule's float32 logits chunk stays under this (with O(N·k) on top: ≤ 256 MiB).
LEAN_CHUNK_BYTES = 232 << 20
LEAN_ROW_MULTIPLE = 64


def default_chunk_rows(num_rows: int, num_columns: int) -> int:
    """Rows per chunk: as few chunks as the byte budget allows, split evenly (chunks under
    ~1024 rows starve the matmuls; equal chunks avoid a small last one)."""
    most = max(CHUNK_ROW_MULTIPLE, DEFAULT_CHUNK_BYTES // (4 * num_columns))
    chunks = -(-max(num_rows, 1) // most)
    rows = -(-num_rows // chunks)
    return max(1, min(num_rows, -(-rows // CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE))


def _fused_support(stats, teacher_logprobs, counted, options: DivergenceOptions, vocab_size, row_weight,
                   log_threshold=None):
    """The O(N·k) loss math in one Triton kernel (closed-form gradients): (per-row loss, KD,
    CE, row stats, `SupportGradients` w.r.t. the statistics, or None without ``row_weight``).
    CE and its two gradients are O(N) torch ops."""
    from ..ops.support_loss import support_loss

    kd_scale = None if row_weight is None else row_weight * options.kd_weight
    kd, grad_ids, grad_lse_tempered = support_loss(teacher_logprobs, stats.at_ids, stats.lse_tempered, counted,
                                                   kd_scale, options, vocab_size, log_threshold)
    ce, label_logprob = None, None
    per_row = options.kd_weight * kd
    if stats.at_label is not None:
        label_logprob = stats.at_label - stats.lse
        ce = torch.where(counted, -label_logprob, 0.0)
        per_row = per_row + options.ce_weight * ce
    row_stats = StudentRowStats(stats.at_ids / options.temperature, stats.lse_tempered, label_logprob, stats.top1)
    grads = None
    if row_weight is not None:
        ce_scale = torch.where(counted, row_weight * options.ce_weight, 0.0)
        with_label = stats.at_label is not None
        grads = SupportGradients(at_ids=grad_ids, at_label=-ce_scale if with_label else None,
                                 lse=ce_scale if with_label else None, lse_tempered=grad_lse_tempered)
    return per_row, kd, ce, row_stats, grads


def lean_chunk_rows(num_rows: int, num_columns: int) -> int:
    """Rows per chunk of the lean schedule: the most whose float32 logits fit LEAN_CHUNK_BYTES."""
    most = LEAN_CHUNK_BYTES // (4 * max(num_columns, 1)) // LEAN_ROW_MULTIPLE * LEAN_ROW_MULTIPLE
    return max(1, min(num_rows, max(LEAN_ROW_MULTIPLE, most)))


def one_read_exp_weight(options: DivergenceOptions, has_labels: bool, grad_dtype: torch.dtype) -> Optional[float]:
    """``w`` of the one-read gradient (module docstring), or None where it does not apply and
    the gradient takes two passes: two dense terms (CE's softmax(z) and the tail mode's
    softmax(z / τ) at τ ≠ 1), or fp16 rows (e' could leave fp16's range)."""
    if grad_dtype not in (torch.bfloat16, torch.float32):
        return None
    # the renormalized support's gradient lives on the ids alone: no dense KD term
    kd_dense = options.support in ("tail", "sampled") and options.temperature != 1.0
    if not kd_dense:
        return 1.0
    with_ce = has_labels and options.ce_weight != 0.0
    return None if with_ce else 1.0 / options.temperature


def _statistics_kernel():
    from ..ops.row_statistics import RowStatistics, row_statistics

    return row_statistics, RowStatistics


def _kernels():
    from ..ops.scale_inplace import scale_inplace
    from ..ops.softmax_gradient import softmax_gradient
    from ..ops.store_columns import store_columns

    return softmax_gradient, scale_inplace, store_columns


@dataclasses.dataclass
class _ChunkStats:
    at_ids: torch.Tensor  # [C, k] float32 raw logits at the (safe) teacher ids
    at_label: Optional[torch.Tensor]  # [C] float32 raw logit at the (safe) label
    lse: torch.Tensor
    lse_tempered: torch.Tensor
    top1: torch.Tensor
    best: torch.Tensor  # [C] float32 row maximum (to merge argmaxes across ranks)
    ids: torch.Tensor  # [C, k] int64, invalid entries -> 0
    labels: Optional[torch.Tensor]  # [C] int64, ignored rows -> 0
    shift: Optional[torch.Tensor] = None  # [C] float32, where the pass wrote exp((z - shift) · w)


def _chunk_stats(logits, bias, ids, safe_labels, out, options: DivergenceOptions, width: int,
                 column_start: int = 0, exp_out=None, exp_weight: float = 1.0) -> _ChunkStats:
    """Statistics of rows whose logits (the ``width`` existing columns of this rank, global ids
    from ``column_start``) are all in memory: one Triton pass into ``out`` (`RowStatistics`
    rows), which also writes ``exp_out`` when given (`row_statistics`). ``ids`` /
    ``safe_labels``: int64, invalid entries and ignored rows -> 0. Ids and labels this rank
    does not own read 0."""
    row_statistics, _ = _statistics_kernel()
    row_statistics(logits, bias, width, options.temperature, out, ids, safe_labels, column_start=column_start,
                   exp_out=exp_out, exp_weight=exp_weight)
    return _ChunkStats(out.at_ids, out.at_label, out.lse, out.lse_tempered, out.top1, out.best, ids, safe_labels,
                       out.shift if exp_out is not None else None)


def _combine_over_ranks(stats: _ChunkStats, shard) -> _ChunkStats:
    """Every rank's statistics of the same rows -> the whole-vocab ones: O(N·k) + O(N·W)."""
    from ..distributed import all_reduce_sum_, combine_argmax, combine_logsumexp

    lse = combine_logsumexp(stats.lse, shard)
    tempered = stats.lse_tempered is not stats.lse
    summed = [stats.at_ids] + ([stats.at_label.unsqueeze(-1)] if stats.at_label is not None else [])
    summed = all_reduce_sum_(torch.cat(summed, -1), shard)  # one collective for ids and label
    k = stats.at_ids.shape[1]
    return dataclasses.replace(
        stats, at_ids=summed[:, :k].contiguous(),
        at_label=summed[:, k] if stats.at_label is not None else None,
        lse=lse, lse_tempered=combine_logsumexp(stats.lse_tempered, shard) if tempered else lse,
        top1=combine_argmax(stats.best, stats.top1, shard))


@dataclasses.dataclass
class _GradientPlan:
    """What the gradient writers need for a range of rows: the dense coefficients of
    softmax(z) and softmax(z / τ) (the latter None when absent or folded in at τ = 1), and
    the sparse columns ``[R, M]`` with their full gradient values ``[R, M]`` (dense + every
    sparse term landing on that column, so duplicate columns agree: an invalid entry's id 0,
    the label among the ids)."""

    coef: torch.Tensor
    coef_tempered: Optional[torch.Tensor]
    lse: torch.Tensor
    lse_tempered: torch.Tensor
    columns: torch.Tensor
    values: torch.Tensor
    row_scale: Optional[torch.Tensor] = None  # [R] float32 s of the one-read form (values divided by it)
    clear: Optional[torch.Tensor] = None  # [R] int8: rows whose dense part is dropped (s = 0)


def _gradient_plan(stats: _ChunkStats, grads, teacher_logprobs, options: DivergenceOptions,
                   exp_weight: Optional[float] = None) -> _GradientPlan:
    from ..ops.gradient_plan import gradient_plan

    coef = grads.lse if grads.lse is not None else torch.zeros_like(stats.lse)
    # d logsumexp(z / τ) / dz = softmax(z / τ) / τ; at τ = 1 both terms are one softmax
    coef_tempered = None if grads.lse_tempered is None else grads.lse_tempered / options.temperature
    if coef_tempered is not None and options.temperature == 1.0:
        coef, coef_tempered = coef + coef_tempered, None
    with_label = grads.at_label is not None
    one_read = exp_weight is not None
    out = gradient_plan(
        teacher_logprobs.contiguous(), grads.at_ids.float().contiguous(), stats.ids, stats.at_ids, stats.lse,
        stats.lse_tempered, coef, coef_tempered, stats.labels if with_label else None,
        stats.at_label if with_label else None, grads.at_label if with_label else None, options.temperature,
        stats.shift if one_read else None, exp_weight if one_read else 1.0)
    return _GradientPlan(coef, coef_tempered, stats.lse, stats.lse_tempered, *out)


def _write_logit_gradient(logits, bias, plan: _GradientPlan, options: DivergenceOptions, vocab_size: int,
                          out: torch.Tensor, column_start: int = 0) -> torch.Tensor:
    """``out [R, C]`` = d objective / d logits for the columns ``[column_start, column_start + C)``
    of rows R; ``vocab_size`` counts the existing columns of this range. out may alias logits."""
    softmax_gradient, _, store_columns = _kernels()
    softmax_gradient(logits, bias, out, plan.lse, plan.lse_tempered, plan.coef, plan.coef_tempered, vocab_size,
                     options.temperature)
    return store_columns(out, plan.columns, plan.values, column_start, column_start + out.shape[1])


class _ChunkedStudentPass:
    """The per-row part both schedules share: teacher rows, counted rows, this rank's columns,
    and the loss math from row statistics (losses, metrics, gradients w.r.t. the statistics)."""

    def __init__(self, teacher_logprobs, teacher_indices, labels, options: DivergenceOptions, vocab_size: int,
                 shard=None, teacher_threshold=None):
        self.shard = shard
        # this rank's existing columns and the global id of the first
        self.width, self.column_start = (vocab_size, 0) if shard is None else (shard.existing, shard.vocab_start)
        self.teacher_logprobs = teacher_logprobs
        self.teacher_indices = teacher_indices
        self.teacher_threshold = teacher_threshold  # [N] log_threshold of support "sampled", else None
        self.labels = labels
        self.options = options
        self.vocab_size = vocab_size

    # The per-row inputs below are made once for all rows (not per chunk: each small op is a
    # launch and a gap on the device) and on first use, after the first chunk's matmul is queued.
    @functools.cached_property
    def safe_ids(self) -> torch.Tensor:
        return torch.where(torch.isfinite(self.teacher_logprobs), self.teacher_indices.long(), 0)

    @functools.cached_property
    def safe_labels(self) -> Optional[torch.Tensor]:
        labels = self.labels
        return None if labels is None else torch.where(labels != self.options.ignore_index, labels.long(), 0)

    @functools.cached_property
    def stats_rows(self):
        _, statistics_type = _statistics_kernel()
        rows, k = self.teacher_logprobs.shape
        return statistics_type.empty(rows, k, self.options.temperature != 1.0, self.labels is not None,
                                     self.teacher_logprobs.device, shift=True)

    @functools.cached_property
    def counted(self) -> torch.Tensor:
        rows = self.teacher_logprobs.shape[0]
        return counted_rows(self.labels, rows, self.options.ignore_index, self.teacher_logprobs.device)

    def support(self, stats: "_ChunkStats", start, stop, row_weight):
        """(per-row loss, KD, CE, row stats, gradients w.r.t. the statistics or None) of rows
        [start, stop)."""
        teacher_logprobs, _, counted = self.rows(start, stop)
        threshold = None if self.teacher_threshold is None else self.teacher_threshold[start:stop]
        return _fused_support(stats, teacher_logprobs, counted, self.options, self.vocab_size, row_weight, threshold)

    def rows(self, start, stop):
        """(teacher log-probs, teacher ids, counted-row mask) of rows [start, stop)."""
        return self.teacher_logprobs[start:stop], self.teacher_indices[start:stop], self.counted[start:stop]

    def step(self, stats: "_ChunkStats", start, stop, row_weight, metrics):
        """Loss math of rows [start, stop) from their statistics: (per-row loss, gradients
        w.r.t. the statistics if ``row_weight`` is given). Adds metric sums into ``metrics``."""
        teacher_logprobs, teacher_indices, counted = self.rows(start, stop)
        per_row, kd, ce, row_stats, grads = self.support(stats, start, stop,
                                                         None if row_weight is None else row_weight[start:stop])
        if metrics is not None:
            sums = row_metrics(row_stats, teacher_logprobs, teacher_indices, counted, kd, ce)
            for index, name in enumerate(_METRIC_NAMES):
                metrics[index] = metrics[index] + sums[name].float()
        return per_row, grads

    def chunk(self, logits, bias, start, stop, row_weight, metrics, exp_out=None, exp_weight: float = 1.0):
        """`step` of rows [start, stop) from their logits ``[stop - start, V]``; also returns the
        stats. ``exp_out``: see `_chunk_stats`."""
        stats = _chunk_stats(logits, bias, self.safe_ids[start:stop],
                             None if self.safe_labels is None else self.safe_labels[start:stop],
                             self.stats_rows.rows(start, stop), self.options, self.width, self.column_start,
                             exp_out, exp_weight)
        if self.shard is not None:
            stats = _combine_over_ranks(stats, self.shard)
        per_row, grads = self.step(stats, start, stop, row_weight, metrics)
        return per_row, stats, grads


def _row_weight(num_rows, counted, options: DivergenceOptions, num_tokens, device) -> torch.Tensor:
    """d loss / d per-row loss for mean and sum: ``1/divisor`` or 1, on the device, no sync."""
    if options.reduction == "sum":
        return torch.ones(num_rows, dtype=torch.float32, device=device)
    if num_tokens is None:
        divisor = counted.sum().clamp(min=1).float()
    else:
        divisor = torch.as_tensor(num_tokens, dtype=torch.float32, device=device)
    return (1.0 / divisor).expand(num_rows)


def _reduce(per_row: torch.Tensor, row_weight: Optional[torch.Tensor], options: DivergenceOptions) -> torch.Tensor:
    if options.reduction == "none":
        return per_row
    return (per_row * row_weight).sum()


def _linear_pass(hidden, weight, bias, student_pass: _ChunkedStudentPass, row_weight, needs, chunk_rows,
                 with_metrics: bool):
    """Chunks over rows: logits by cuBLAS, statistics and gradients by the Triton passes.
    ``row_weight``: None (no gradients) or a function making the ``[N]`` d loss / d per-row
    loss, called once the first matmul is queued (its small ops then run behind it).
    Returns per-row loss, metric sums (or None), (grad_hidden, grad_weight, grad_bias) and the
    row weights."""
    num_rows, num_columns = hidden.shape[0], weight.shape[0]
    device = hidden.device
    want_grads = row_weight is not None and any(needs)
    chunk_rows = chunk_rows or default_chunk_rows(num_rows, num_columns)
    logits = torch.empty(min(chunk_rows, num_rows), num_columns, dtype=torch.float32, device=device)
    per_row = torch.empty(num_rows, dtype=torch.float32, device=device)
    metrics = [torch.zeros((), device=device) for _ in _METRIC_NAMES] if with_metrics else None
    grad_hidden = torch.empty_like(hidden) if want_grads and needs[0] else None
    grad_weight = None
    if want_grads and needs[1]:  # the first chunk writes it (no rows: nothing will)
        grad_weight = torch.empty_like(weight) if num_rows else torch.zeros_like(weight)
    grad_bias = torch.zeros(num_columns, dtype=torch.float32, device=device) if want_grads and needs[2] else None
    options = student_pass.options
    exp_weight = one_read_exp_weight(options, student_pass.labels is not None, hidden.dtype) if want_grads else None
    scaled_hidden = None  # the hidden rows of dW, times s, in the one-read form
    if exp_weight is not None and grad_weight is not None:
        scaled_hidden = torch.empty(min(chunk_rows, num_rows), hidden.shape[1], dtype=hidden.dtype, device=device)
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        hidden_chunk = hidden[start:stop]
        chunk_logits = logits[:stop - start]
        _lm_head_logits_fp32(hidden_chunk, weight, chunk_logits)
        if start == 0 and row_weight is not None:
            row_weight = row_weight()
        # the gradient row, in the input dtype, overwrites the first bytes of its float32 logits row
        chunk_grad = chunk_logits.view(hidden.dtype)[:, :num_columns]
        per_row[start:stop], stats, grads = student_pass.chunk(
            chunk_logits, bias, start, stop, row_weight if want_grads else None, metrics,
            chunk_grad if exp_weight is not None else None, exp_weight or 1.0)
        if not want_grads:
            continue
        plan = _gradient_plan(stats, grads, student_pass.teacher_logprobs[start:stop], options, exp_weight)
        if plan.row_scale is None:
            _write_logit_gradient(chunk_logits, bias, plan, options, student_pass.width, chunk_grad,
                                  student_pass.column_start)
        else:
            store_columns = _kernels()[2]
            store_columns(chunk_grad, plan.columns, plan.values, student_pass.column_start,
                          student_pass.column_start + num_columns, clear=plan.clear)
        _accumulate_matmul_gradients(chunk_grad, plan.row_scale, hidden_chunk, weight, start,
                                     grad_hidden, grad_weight, grad_bias, scaled_hidden)
    if grad_hidden is not None and student_pass.shard is not None:
        from ..distributed import all_reduce_sum_

        all_reduce_sum_(grad_hidden, student_pass.shard)  # hidden is replicated: Σ_r dlogits_r @ W_r
    grads = (grad_hidden, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype))
    if callable(row_weight):  # no rows
        row_weight = row_weight()
    return per_row, (None if metrics is None else torch.stack(metrics)), grads, row_weight


def _accumulate_matmul_gradients(chunk_grad, row_scale, hidden_chunk, weight, start, grad_hidden, grad_weight,
                                 grad_bias, scaled_hidden):
    """dX rows, dW and dBias of one chunk from its logit gradient ``diag(row_scale) · chunk_grad``
    (row_scale None: the gradient itself). dW is written by the first chunk, added by the others."""
    from ..ops.scale_rows import scale_rows

    rows = chunk_grad.shape[0]
    if grad_hidden is not None:
        grad_rows = grad_hidden[start:start + rows]
        torch.mm(chunk_grad, weight, out=grad_rows)
        if row_scale is not None:
            scale_rows(grad_rows, row_scale, grad_rows)
    if grad_weight is not None:
        dw_rows = hidden_chunk if row_scale is None else scale_rows(hidden_chunk, row_scale, scaled_hidden[:rows])
        if start == 0:
            torch.mm(chunk_grad.T, dw_rows, out=grad_weight)  # no zero fill and re-read of V·H
        else:
            grad_weight.addmm_(chunk_grad.T, dw_rows)
    if grad_bias is not None:
        grad_logits = chunk_grad.float()
        grad_bias += (grad_logits if row_scale is None else grad_logits * row_scale[:, None]).sum(0)


def _schedule(hidden, weight, bias, student_pass, row_weight, needs, chunk_rows, lean, with_metrics):
    if lean:
        chunk_rows = lean_chunk_rows(hidden.shape[0], weight.shape[0])
    return _linear_pass(hidden, weight, bias, student_pass, row_weight, needs, chunk_rows, with_metrics)


class LinearTopKDivergence(torch.autograd.Function):
    """loss = f(hidden @ weight.T + bias); see the module docstring for how."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_logprobs, teacher_indices, teacher_threshold, labels, num_tokens,
                options: DivergenceOptions, vocab_size: int, chunk_rows, lean: bool, with_metrics: bool, shard):
        student_pass = _ChunkedStudentPass(teacher_logprobs, teacher_indices, labels, options, vocab_size, shard,
                                           teacher_threshold)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])

        def weigh_rows():
            return _row_weight(hidden.shape[0], student_pass.counted, options, num_tokens, hidden.device)

        per_row, metrics, grads, row_weight = _schedule(
            hidden, weight, bias, student_pass, weigh_rows if options.reduction != "none" else None, needs, chunk_rows,
            lean, with_metrics)
        ctx.options, ctx.chunk_rows, ctx.lean, ctx.needs, ctx.backward_done = options, chunk_rows, lean, needs, False
        ctx.student_pass = student_pass if options.reduction == "none" else None
        ctx.save_for_backward(*(grads if options.reduction != "none" else (hidden, weight, bias)))
        loss = _reduce(per_row, row_weight, options)
        if metrics is None:
            metrics = torch.zeros(0, device=hidden.device)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        if ctx.options.reduction == "none":
            hidden, weight, bias = ctx.saved_tensors
            _, _, grads, _ = _schedule(hidden, weight, bias, ctx.student_pass, grad_loss.float, ctx.needs,
                                       ctx.chunk_rows, ctx.lean, with_metrics=False)
        else:
            if ctx.backward_done:
                raise RuntimeError("topk_divergence: backward ran twice through the same graph; the fused "
                                   "kernels scale their saved gradients in place (no retain_graph reuse)")
            ctx.backward_done = True
            # In place (a scaled copy of dW would cost another V·H buffer), and nothing moves
            # when the upstream gradient is 1.
            scale_inplace = _kernels()[1]
            grads = tuple(None if g is None else scale_inplace(g, grad_loss) for g in ctx.saved_tensors)
        return (*grads, None, None, None, None, None, None, None, None, None, None, None)


class LogitsTopKDivergence(torch.autograd.Function):
    """loss = f(logits); statistics in forward, ``[N, V]`` gradient written once in backward."""

    @staticmethod
    def forward(ctx, logits, teacher_logprobs, teacher_indices, teacher_threshold, labels, num_tokens,
                options: DivergenceOptions, vocab_size: int, with_metrics: bool, shard):
        student_pass = _ChunkedStudentPass(teacher_logprobs, teacher_indices, labels, options, vocab_size, shard,
                                           teacher_threshold)
        metrics = [torch.zeros((), device=logits.device) for _ in _METRIC_NAMES] if with_metrics else None
        per_row, stats, _ = student_pass.chunk(logits, None, 0, logits.shape[0], None, metrics)
        row_weight = None
        if options.reduction != "none":
            row_weight = _row_weight(logits.shape[0], student_pass.counted, options, num_tokens, logits.device)
        ctx.student_pass, ctx.stats, ctx.row_weight = student_pass, stats, row_weight
        ctx.save_for_backward(logits)
        metrics = torch.zeros(0, device=logits.device) if metrics is None else torch.stack(metrics)
        ctx.mark_non_differentiable(metrics)
        return _reduce(per_row, row_weight, options), metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        (logits,) = ctx.saved_tensors
        student_pass, stats = ctx.student_pass, ctx.stats
        options = student_pass.options
        row_weight = grad_loss.float() if options.reduction == "none" else ctx.row_weight * grad_loss.float()
        teacher_logprobs = student_pass.teacher_logprobs
        *_, grads = student_pass.support(stats, 0, logits.shape[0], row_weight)
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        _write_logit_gradient(logits, None, _gradient_plan(stats, grads, teacher_logprobs, options), options,
                              student_pass.width, grad_logits, student_pass.column_start)
        return grad_logits, None, None, None, None, None, None, None, None, None


def _metrics_dict(metrics: torch.Tensor) -> dict:
    out = {name: metrics[index] for index, name in enumerate(_METRIC_NAMES)}
    out["rows"] = out["rows"].long()
    return out


def _num_tokens_arg(num_tokens):
    return num_tokens if num_tokens is None or isinstance(num_tokens, torch.Tensor) else float(num_tokens)


def _threshold(teacher, options: DivergenceOptions) -> Optional[torch.Tensor]:
    """The samples' float32 ``log_threshold [N]`` for support "sampled", else None."""
    return teacher.log_threshold.float().contiguous() if options.support == "sampled" else None


@torch.compiler.disable
def fused_topk_divergence(hidden, weight, bias, teacher: TopK, labels, options: DivergenceOptions, num_tokens,
                          return_metrics: bool, chunk_rows: Optional[int], lean: bool = False, shard=None):
    """The Triton path of `kd_kernels.topk_divergence` (inputs already validated).

    Under ``torch.compile`` this is a graph break (compiled code around it runs as usual)."""
    loss, metrics = LinearTopKDivergence.apply(
        hidden, weight, bias, teacher.logprobs, teacher.indices, _threshold(teacher, options), labels,
        _num_tokens_arg(num_tokens), options, options.vocab_size, chunk_rows, lean, return_metrics, shard)
    return (loss, _metrics_dict(metrics)) if return_metrics else loss


@torch.compiler.disable
def fused_topk_divergence_from_logits(logits, teacher: TopK, labels, options: DivergenceOptions, num_tokens,
                                      return_metrics: bool, shard=None):
    """The Triton path of `kd_kernels.topk_divergence_from_logits` (inputs already validated)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    loss, metrics = LogitsTopKDivergence.apply(logits, teacher.logprobs, teacher.indices, _threshold(teacher, options),
                                               labels,
                                               _num_tokens_arg(num_tokens), options, options.vocab_size,
                                               return_metrics, shard)
    return (loss, _metrics_dict(metrics)) if return_metrics else loss
