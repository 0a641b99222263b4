"""Public functions: validate, pick a backend, run. The math is in SPEC.md and `reference`."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import torch_backend
from .backends import CUDA_MAX_TOPK, resolve_backend, triton_interpreter_enabled
from .distributed import vocab_shard
from .options import DivergenceOptions, check_temperature
from .topk import TopK
from .validation import (
    check_k,
    check_label_values,
    check_labels,
    check_lm_head,
    check_logits,
    check_num_tokens,
    check_schedule_options,
    check_teacher,
    check_teacher_values,
    resolve_vocab_size,
    without_out_of_range_ids,
)

_LOGPROBS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_logprobs_dtype(logprobs_dtype: torch.dtype) -> None:
    if logprobs_dtype not in _LOGPROBS_DTYPES:
        raise TypeError(f"logprobs_dtype: expected one of {_LOGPROBS_DTYPES}, got {logprobs_dtype}")


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def _vocab(group, local_columns: int, vocab_size, argument: str):
    """(V*, this rank's `VocabShard` or None): under a group of W ranks the shards hold
    ``W · local_columns`` columns in all."""
    vocab_size = resolve_vocab_size(vocab_size, local_columns * _group_size(group), argument)
    return vocab_size, vocab_shard(group, local_columns, vocab_size)


def _finish_topk(topk: TopK, logprobs_dtype: torch.dtype) -> TopK:
    return TopK(topk.logprobs.to(logprobs_dtype), topk.indices.to(torch.int32), topk.lse.float(), topk.temperature)


def _teacher_backend(backend: str, op: str, device: torch.device, k: int) -> str:
    """The backend of a teacher op; "auto" passes over cuda for k above its kernel's limit."""
    chosen = resolve_backend(backend, op, device, skip_cuda=k > CUDA_MAX_TOPK)
    if chosen == "cuda" and k > CUDA_MAX_TOPK:
        raise ValueError(f"k: backend='cuda' selects at most {CUDA_MAX_TOPK} entries, got {k}; "
                         "use backend='triton' (or 'auto') for larger k")
    return chosen


@torch.no_grad()
def teacher_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int = 64, *, temperature: float = 1.0,
                 vocab_size: Optional[int] = None, bias: Optional[torch.Tensor] = None, group=None,
                 logprobs_dtype: torch.dtype = torch.float32, backend: str = "auto",
                 chunk_rows: Optional[int] = None, lean: bool = False) -> TopK:
    """Top-k of the teacher's tempered distribution straight from hidden states and lm_head.

    Equals ``torch.log_softmax((hidden @ weight.T + bias)[:, :V*].float() / temperature, -1).topk(k)``
    with ties broken towards the lower id, but never holds ``[N, V]`` logits on the GPU backends.

    Args:
        hidden: ``[N, H]`` float32 / bfloat16 / float16 teacher final hidden states.
        weight: ``[V, H]`` the teacher lm_head (its vocab shard under ``group``), same dtype.
        k: entries per row, 1 <= k <= V*.
        temperature: τ_t > 0.
        vocab_size: V*, columns at or past it (padded lm_head rows) do not exist.
        bias: optional ``[V]``.
        logprobs_dtype: dtype of ``TopK.logprobs``.
        backend: "auto" | "cuda" | "triton" | "torch" (see `available_backends`); "auto" takes
            cuda (the CUDA extension, k <= 1024) when built, else triton (no compiled extension
            needed), on a CUDA device; torch (the float64 reference) on CPU. bf16 / fp16 inputs
            take, on either GPU backend, a Triton matmul whose epilogue also summarizes each row,
            and store no chunk of logits up to k = 1024: at k <= 64 the maxima schedule (each
            32-column group's maximum, its column and its second largest give the top-k, the few
            groups holding two top-k elements computed again), past it the appended schedule
            (floors from a strided sample of the columns, the matmul appending each element that
            reaches its row's floor, one ranking per row: the extension's sort on cuda, a Triton
            selection then a sort of k on triton); both within ~56 MiB beyond the outputs
            whatever N and V. Float32 inputs and k > 1024 take cuBLAS float32 logits a chunk of
            rows at a time, then the backend's full-row selection, which also redoes the rows of
            massive ties the other schedules flag.
        chunk_rows: None or rows per chunk on the GPU backends (``chunk_rows · V · 4`` bytes for
            the cuBLAS logits chunks); None: ~1.25 GiB of logits, or within ~56 MiB for the
            maxima and appended schedules.
        lean: ≤ ~64 MiB beyond the inputs and outputs whatever N and V: the maxima and appended
            schedules as above where they apply, else tiles of rows × vocab columns (48 MiB of
            float32 logits plus ~16 MiB for merging) instead of chunks of whole rows. Not with
            ``chunk_rows``.
    Returns:
        `TopK` with ``logprobs [N, k]``, ``indices [N, k]`` int32, ``lse [N]`` float32.
    """
    check_lm_head(hidden, weight, bias)
    check_temperature(temperature)
    check_schedule_options(chunk_rows, lean)
    vocab_size, shard = _vocab(group, weight.shape[0], vocab_size, "weight")
    check_k(k, vocab_size)
    _check_logprobs_dtype(logprobs_dtype)
    chosen = _teacher_backend(backend, "teacher_topk", hidden.device, k)
    if chosen == "triton" and hidden.dtype == torch.bfloat16 and triton_interpreter_enabled():
        raise TypeError("hidden: bfloat16 on the triton backend under TRITON_INTERPRET=1 is refused (the "
                        "interpreter's bf16 tl.dot is wrong); pass float32 or float16 inputs, or backend='torch'")
    if chosen in ("cuda", "triton"):
        from .teacher.schedule import teacher_topk as scheduled, teacher_topk_lean

        if lean:
            topk = teacher_topk_lean(hidden, weight, k, temperature, vocab_size, bias, shard, select=chosen)
        else:
            topk = scheduled(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select=chosen)
    else:
        topk = torch_backend.teacher_topk(hidden, weight, k, temperature, vocab_size, bias, shard)
    return _finish_topk(topk, logprobs_dtype)


@torch.no_grad()
def teacher_topk_from_logits(logits: torch.Tensor, k: int = 64, *, temperature: float = 1.0,
                             vocab_size: Optional[int] = None, group=None,
                             logprobs_dtype: torch.dtype = torch.float32, backend: str = "auto") -> TopK:
    """`teacher_topk` for callers that already hold ``[N, V]`` logits (any float dtype).

    Equals ``torch.log_softmax(logits[:, :V*].float() / temperature, -1).topk(k)``, lower id first on ties.
    """
    check_logits(logits)
    check_temperature(temperature)
    vocab_size, shard = _vocab(group, logits.shape[1], vocab_size, "logits")
    check_k(k, vocab_size)
    _check_logprobs_dtype(logprobs_dtype)
    chosen = _teacher_backend(backend, "teacher_topk_from_logits", logits.device, k)
    if chosen in ("cuda", "triton"):
        from .teacher.logits_rows import teacher_topk_from_logits as from_logits

        if logits.shape[1] > 1 and logits.stride(1) != 1:
            raise ValueError(f"logits: the {chosen} backend reads rows in place and needs contiguous rows "
                             f"(logits.stride(1) == 1), got strides {tuple(logits.stride())}; pass "
                             "logits.contiguous() (a copy of [N, V])")

        topk = from_logits(logits, k, temperature, vocab_size, shard, select=chosen)
    else:
        topk = torch_backend.teacher_topk_from_logits(logits, k, temperature, vocab_size, shard)
    return _finish_topk(topk, logprobs_dtype)


def _loss_options(arguments: dict) -> dict:
    """The `DivergenceOptions` fields (and vocab_size) among a public function's arguments."""
    names = [field.name for field in dataclasses.fields(DivergenceOptions)]
    return {name: arguments[name] for name in names}


def _student_options(group, local_columns: int, argument: str, teacher: TopK, kwargs: dict):
    """(options with the global V*, this rank's `VocabShard` or None)."""
    vocab_size, shard = _vocab(group, local_columns, kwargs.pop("vocab_size", None), argument)
    options = DivergenceOptions(vocab_size=vocab_size, **kwargs)
    if _teacher_temperature(teacher) is not None and teacher.temperature != options.temperature:
        raise ValueError(f"temperature: the student temperature {options.temperature} differs from the teacher's "
                         f"{teacher.temperature} (teacher.temperature); score both at one temperature, or set "
                         "teacher.temperature = None to mix them on purpose")
    return options, shard


def _teacher_temperature(teacher) -> Optional[float]:
    """The temperature a `TopK` / `TeacherSamples` was scored at (None: unknown, or another type)."""
    from .samples import TeacherSamples

    return teacher.temperature if isinstance(teacher, (TopK, TeacherSamples)) else None


def _check_student_inputs(num_rows: int, device, teacher, labels, options: DivergenceOptions,
                          num_tokens, check_values: bool):
    """Checks; returns the teacher to use: with the value checks off, entries whose ids lie
    outside [0, V*) are made invalid (with them on, such ids are refused)."""
    check_teacher(teacher, num_rows, device, options.support)
    check_labels(labels, num_rows, device, options.ce_weight)
    check_num_tokens(num_tokens)
    if not check_values:
        return without_out_of_range_ids(teacher, options.vocab_size)
    check_teacher_values(teacher, options.vocab_size, options.support)
    check_label_values(labels, options.ignore_index, options.vocab_size)
    return teacher


def _loss_dtype_result(result, input_dtype: torch.dtype, return_metrics: bool):
    """The loss in float32, or float64 for float64 inputs."""
    dtype = torch.promote_types(input_dtype, torch.float32)
    if return_metrics:
        loss, metrics = result
        return loss.to(dtype), metrics
    return result.to(dtype)


def topk_divergence(hidden: torch.Tensor, weight: torch.Tensor, teacher: TopK, labels: Optional[torch.Tensor] = None, *,
                    divergence: str = "forward_kl", temperature: float = 1.0, support: str = "renormalized",
                    kd_weight: float = 1.0, ce_weight: float = 0.0, beta: float = 0.5, skew_lambda: float = 0.1,
                    adaptive_alpha: float = 0.5, ignore_index: int = -100, reduction: str = "mean",
                    num_tokens=None, vocab_size: Optional[int] = None, bias: Optional[torch.Tensor] = None,
                    group=None, return_metrics: bool = False, check_values: bool = True,
                    backend: str = "auto", chunk_rows: Optional[int] = None, lean: bool = False):
    """Top-k distillation loss (+ cross-entropy) of the student, fused with its lm_head.

    ``loss = kd_weight · KD + ce_weight · CE``, reduced by ``reduction``, where per row
    ``KD = D(p ‖ q)`` over the teacher's top-k bins (``support``), e.g. forward KL
    ``Σ p (log p − log q)`` with p the teacher and q the student at ``temperature``, and
    ``CE = −log_softmax(z)[label]``, ``z = hidden @ weight.T + bias``. Equals
    ``topk_divergence_from_logits(hidden @ weight.T + bias, teacher, labels, ...)`` without
    ever holding ``[N, V]`` logits on the fused backends. No τ² factor is applied.

    Args:
        hidden: ``[N, H]`` float32 / bfloat16 / float16 student final hidden states (rows are tokens).
        weight: ``[V, H]`` the student lm_head, same dtype.
        teacher: `TopK` with ``[N, k]`` log-probs and ids from `teacher_topk`; for
            support="sampled" a `TeacherSamples` from `teacher_sample`.
        labels: ``[N]`` int, already shifted (row n predicts token n + 1); ``ignore_index``
            rows count for nothing. None: every row counts for KD, ``ce_weight`` must be 0.
        divergence: forward_kl | reverse_kl | jsd | skewed_forward_kl | skewed_reverse_kl |
            adaptive_kl | tvd (SPEC.md's table; ``beta``, ``skew_lambda``, ``adaptive_alpha``).
        support: "renormalized" (both sides softmaxed over the k ids), "tail" (k + 1 bins) or
            "sampled": KD is the unbiased estimate of the full-vocab divergence from the
            teacher's Gumbel-top-n samples, ``Σ_i t'(p_i, q_i) / π_i`` (`sampling`; its mean over
            seeds is the full-vocab divergence, its gradient's mean the full-vocab gradient).
            Every divergence but adaptive_kl (refused: no unbiased sampled form).
        reduction: "mean" (over ``num_tokens`` if given, else counted rows), "sum" or "none" (``[N]``).
        return_metrics: also return a dict of detached sums (see SPEC "Loss").
        check_values: check teacher ids, NaN log-probs and labels on the device (one host sync).
            Off, an entry whose teacher id lies outside [0, V*) counts as invalid (log-prob -inf).
        backend: "auto" | "triton" | "cuda" | "torch".
        chunk_rows: None or rows per chunk of the default schedule (triton backend): extra memory
            is ``chunk_rows · V · 4`` bytes; None picks ~1.25 GiB worth.
        lean: the lean schedule instead (triton backend): chunks of ≤ 232 MiB of float32 logits
            (384 rows at V = 151,936), ≤ 256 MiB extra whatever N, for one more read-modify-write
            of the weight gradient per chunk. Not with ``chunk_rows``.
    Returns:
        float32 loss (float64 for float64 inputs), a scalar or ``[N]`` for reduction="none"; and the
        metrics dict if asked.
    """
    check_lm_head(hidden, weight, bias)
    check_schedule_options(chunk_rows, lean)
    options, shard = _student_options(group, weight.shape[0], "weight", teacher, _loss_options(locals()))
    teacher = _check_student_inputs(hidden.shape[0], hidden.device, teacher, labels, options, num_tokens,
                                    check_values)
    chosen = resolve_backend(backend, "topk_divergence", hidden.device)
    if chosen == "triton":
        from .autograd.student_loss import fused_topk_divergence

        return fused_topk_divergence(hidden, weight, bias, teacher, labels, options, num_tokens, return_metrics,
                                     chunk_rows, lean, shard)
    result = torch_backend.topk_divergence(hidden, weight, bias, teacher, labels, options, num_tokens, shard,
                                           return_metrics)
    return _loss_dtype_result(result, hidden.dtype, return_metrics)


def topk_divergence_from_logits(logits: torch.Tensor, teacher: TopK, labels: Optional[torch.Tensor] = None, *,
                                divergence: str = "forward_kl", temperature: float = 1.0,
                                support: str = "renormalized", kd_weight: float = 1.0, ce_weight: float = 0.0,
                                beta: float = 0.5, skew_lambda: float = 0.1, adaptive_alpha: float = 0.5,
                                ignore_index: int = -100, reduction: str = "mean", num_tokens=None,
                                vocab_size: Optional[int] = None, group=None, return_metrics: bool = False,
                                check_values: bool = True, backend: str = "auto"):
    """`topk_divergence` for callers that already hold ``[N, V]`` student logits (e.g. HF models).

    Same math and arguments; the gradient reaches ``logits``.
    """
    check_logits(logits)
    options, shard = _student_options(group, logits.shape[1], "logits", teacher, _loss_options(locals()))
    teacher = _check_student_inputs(logits.shape[0], logits.device, teacher, labels, options, num_tokens,
                                    check_values)
    chosen = resolve_backend(backend, "topk_divergence_from_logits", logits.device)
    if chosen == "triton":
        from .autograd.student_loss import fused_topk_divergence_from_logits

        return fused_topk_divergence_from_logits(logits, teacher, labels, options, num_tokens, return_metrics, shard)
    result = torch_backend.topk_divergence_from_logits(logits, teacher, labels, options, num_tokens, shard,
                                                       return_metrics)
    return _loss_dtype_result(result, logits.dtype, return_metrics)


def _check_sampling(num_samples, vocab_size: int, seed, row_offset) -> None:
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or not 1 <= num_samples <= vocab_size:
        raise ValueError(f"num_samples: expected an int in [1, {vocab_size}] (the vocab size V*), got {num_samples!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {seed!r}")
    if not isinstance(row_offset, int) or isinstance(row_offset, bool) or not 0 <= row_offset < 1 << 62:
        raise ValueError(f"row_offset: expected an int in [0, 2**62), got {row_offset!r}")


def _sampling_backend(backend: str, op: str, device: torch.device, num_samples: int) -> str:
    chosen = resolve_backend(backend, op, device)
    if chosen == "triton":
        from .teacher_sampling import SAMPLE_MAX  # imports the Triton kernels

        if num_samples > SAMPLE_MAX:
            raise ValueError(f"num_samples: the triton backend draws at most {SAMPLE_MAX} a row, got {num_samples}")
    return chosen


def _finish_samples(samples, logprobs_dtype: torch.dtype):
    """The backend's samples in `TeacherSamples`' dtypes, with ``logprobs_dtype`` log-probs (the
    triton backend's are float32 already: returned as they are)."""
    from .samples import TeacherSamples

    if (samples.logprobs.dtype == logprobs_dtype and samples.indices.dtype == torch.int32
            and samples.log_threshold.dtype == samples.lse.dtype == torch.float32):
        return samples
    return TeacherSamples(samples.logprobs.to(logprobs_dtype), samples.indices.to(torch.int32),
                          samples.log_threshold.float(), samples.lse.float(), samples.temperature, samples.seed)


@torch.no_grad()
def teacher_sample(hidden: torch.Tensor, weight: torch.Tensor, num_samples: int = 16, *, seed: int,
                   temperature: float = 1.0, vocab_size: Optional[int] = None, bias: Optional[torch.Tensor] = None,
                   row_offset: int = 0, logprobs_dtype: torch.dtype = torch.float32, backend: str = "auto"):
    """``num_samples`` token ids a row drawn without replacement from the teacher's tempered
    distribution, straight from hidden states and lm_head, for the unbiased sampled KD.

    With ``p = softmax((hidden @ weight.T + bias)[:, :V*].float() / temperature)`` and keys
    ``κ_v = log p_v + G_v`` (G standard Gumbel noise, a function of (seed, row_offset + row,
    column) only: `kd_kernels.sampling`), the samples are the n largest keys in descending key
    order (Gumbel-top-n: the first a draw from p, each next one a draw from the rest), the
    threshold the (n+1)-th. Equals `kd_kernels.reference.teacher_sample` up to float32 rounding
    of the keys (ids may differ only where two keys are within it); for bf16 / fp16 inputs on the
    triton backend, never holds ``[N, V]`` logits (the sampling matmul's epilogue keeps the
    elements that may reach a floor; docs/DESIGN.md, "Sampled sparse KD") and never waits on the
    device: a row of more keys tied in float32 than its candidate slots (logits of ~1e9, where
    the noise is lost in rounding) gets NaN log-probs and threshold and ids 0, where float32
    inputs raise ``RuntimeError``.

    Args:
        hidden: ``[N, H]`` float32 / bfloat16 / float16 teacher final hidden states.
        weight: ``[V, H]`` the teacher lm_head, same dtype.
        num_samples: n, 1 <= n <= V* (<= 1023 on the triton backend).
        seed: int in [0, 2**64): the same seed gives the same samples on every backend.
        temperature: τ_t > 0.
        vocab_size: V*, columns at or past it (padded lm_head rows) do not exist.
        bias: optional ``[V]``.
        row_offset: the global index of hidden's first row (the noise's row): scoring a dataset
            in pieces with their offsets draws what one call over it would.
        logprobs_dtype: dtype of ``TeacherSamples.logprobs``.
        backend: "auto" | "triton" | "torch" (no compiled CUDA kernel samples).
    Returns:
        `TeacherSamples` with ``logprobs [N, n]``, ``indices [N, n]`` int32, ``log_threshold [N]``
        and ``lse [N]`` float32.
    """
    check_lm_head(hidden, weight, bias)
    check_temperature(temperature)
    vocab_size = resolve_vocab_size(vocab_size, weight.shape[0], "weight")
    _check_sampling(num_samples, vocab_size, seed, row_offset)
    _check_logprobs_dtype(logprobs_dtype)
    if _sampling_backend(backend, "teacher_sample", hidden.device, num_samples) == "triton":
        from . import teacher_sampling as schedules

        samples = schedules.teacher_sample(hidden, weight, num_samples, temperature, vocab_size, bias, seed,
                                           row_offset)
    else:
        samples = torch_backend.teacher_sample(hidden, weight, num_samples, temperature, vocab_size, bias, seed,
                                               row_offset)
    return _finish_samples(samples, logprobs_dtype)


@torch.no_grad()
def teacher_sample_from_logits(logits: torch.Tensor, num_samples: int = 16, *, seed: int, temperature: float = 1.0,
                               vocab_size: Optional[int] = None, row_offset: int = 0,
                               logprobs_dtype: torch.dtype = torch.float32, backend: str = "auto"):
    """`teacher_sample` for callers that already hold ``[N, V]`` logits (any float dtype):
    keys ``log_softmax(logits[:, :V*].float() / temperature, -1) + G``, the same samples."""
    check_logits(logits)
    check_temperature(temperature)
    vocab_size = resolve_vocab_size(vocab_size, logits.shape[1], "logits")
    _check_sampling(num_samples, vocab_size, seed, row_offset)
    _check_logprobs_dtype(logprobs_dtype)
    if _sampling_backend(backend, "teacher_sample_from_logits", logits.device, num_samples) == "triton":
        from . import teacher_sampling as schedules

        if logits.shape[1] > 1 and logits.stride(1) != 1:
            raise ValueError("logits: the triton backend reads rows in place and needs contiguous rows "
                             f"(logits.stride(1) == 1), got strides {tuple(logits.stride())}; pass "
                             "logits.contiguous() (a copy of [N, V])")
        samples = schedules.teacher_sample_from_logits(logits, num_samples, temperature, vocab_size, seed, row_offset)
    else:
        samples = torch_backend.teacher_sample_from_logits(logits, num_samples, temperature, vocab_size, seed,
                                                           row_offset)
    return _finish_samples(samples, logprobs_dtype)
