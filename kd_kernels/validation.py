"""Input checks of the public API: run before any kernel launch, errors name the argument."""
from __future__ import annotations

import dataclasses

from typing import Optional

import torch

from .samples import TeacherSamples
from .topk import TopK


def check_floating(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor (float32, bfloat16, float16, float64), got {tensor.dtype}")


def check_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name}: expected shape {layout}, got {tuple(tensor.shape)}")


def check_same_device(name: str, tensor: torch.Tensor, device: torch.device, other: str) -> None:
    if tensor.device != device:
        raise ValueError(f"{name}: expected to be on {device} like {other}, got {tensor.device}")


def check_lm_head(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """hidden ``[N, H]``, weight ``[V_local, H]``, bias ``[V_local]``: floating, same device and dtype."""
    check_floating("hidden", hidden)
    check_floating("weight", weight)
    check_rank("hidden", hidden, 2, "[N, H] (flatten batch and sequence first)")
    check_rank("weight", weight, 2, "[V_local, H]")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: expected [V_local, H] with H = {hidden.shape[1]} (hidden's last dim), got {tuple(weight.shape)}")
    check_same_device("weight", weight, hidden.device, "hidden")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} like hidden, got {weight.dtype}")
    if bias is not None:
        check_floating("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected shape [{weight.shape[0]}] (weight's rows), got {tuple(bias.shape)}")
        check_same_device("bias", bias, hidden.device, "hidden")


def check_logits(logits: torch.Tensor) -> None:
    check_floating("logits", logits)
    check_rank("logits", logits, 2, "[N, V_local] (flatten batch and sequence first)")


def resolve_vocab_size(vocab_size: Optional[int], columns: int, argument: str) -> int:
    """V*: ``vocab_size`` or the number of columns; must lie in [1, columns]."""
    if vocab_size is None:
        return columns
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 1 <= vocab_size <= columns:
        raise ValueError(f"vocab_size: expected an int in [1, {columns}] ({argument} has {columns} columns), got {vocab_size!r}")
    return vocab_size


def check_schedule_options(chunk_rows, lean) -> None:
    """``chunk_rows``: None or an int >= 1; ``lean``: a bool; not both (lean sets its own chunks)."""
    if not isinstance(lean, bool):
        raise TypeError(f"lean: expected a bool, got {type(lean).__name__}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows: expected None or an int >= 1, got {chunk_rows!r}")
    if lean and chunk_rows is not None:
        raise ValueError("chunk_rows: lean=True sets its own chunks; pass lean=True or chunk_rows, not both")


def check_k(k: int, vocab_size: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= vocab_size:
        raise ValueError(f"k: expected an int in [1, {vocab_size}] (the vocab size V*), got {k!r}")


def check_teacher(teacher, num_rows: int, device: torch.device, support: str = "renormalized") -> None:
    """Types, shapes and devices: a `TopK` for support "renormalized" / "tail", a `TeacherSamples`
    (whose estimator needs its ``log_threshold [N]``) for support "sampled"."""
    if support == "sampled":
        if not isinstance(teacher, TeacherSamples):
            raise TypeError(f"teacher: support='sampled' expects a kd_kernels.TeacherSamples (from teacher_sample), "
                            f"got {type(teacher).__name__}")
        threshold = teacher.log_threshold
        if not isinstance(threshold, torch.Tensor) or not threshold.is_floating_point() \
                or tuple(threshold.shape) != (num_rows,):
            raise ValueError(f"teacher.log_threshold: expected a float tensor of shape [{num_rows}], got "
                             f"{getattr(threshold, 'dtype', type(threshold).__name__)} "
                             f"{tuple(getattr(threshold, 'shape', ()))}")
        check_same_device("teacher.log_threshold", threshold, device, "the student tensors")
    elif not isinstance(teacher, TopK):
        hint = " (samples are read with support='sampled')" if isinstance(teacher, TeacherSamples) else ""
        raise TypeError(f"teacher: support={support!r} expects a kd_kernels.TopK, got {type(teacher).__name__}{hint}")
    logprobs, indices = teacher.logprobs, teacher.indices
    check_floating("teacher.logprobs", logprobs)
    check_rank("teacher.logprobs", logprobs, 2, "[N, k]")
    if logprobs.shape[0] != num_rows or logprobs.shape[1] < 1:
        raise ValueError(f"teacher.logprobs: expected [N, k] with N = {num_rows} rows and k >= 1, got {tuple(logprobs.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"teacher.indices: expected int32 or int64, got {indices.dtype}")
    if indices.shape != logprobs.shape:
        raise ValueError(f"teacher.indices: expected shape {tuple(logprobs.shape)} like teacher.logprobs, got {tuple(indices.shape)}")
    check_same_device("teacher.logprobs", logprobs, device, "the student tensors")
    check_same_device("teacher.indices", indices, device, "the student tensors")


def check_teacher_values(teacher, vocab_size: int, support: str) -> None:
    """Value checks (one host sync): NaN log-probs, ids outside [0, V*), log-probs > 0 in tail and
    sampled mode, a NaN or +inf ``log_threshold`` in sampled mode."""
    logprobs, indices = teacher.logprobs, teacher.indices
    valid = torch.isfinite(logprobs)
    bad_nan = torch.isnan(logprobs).any()
    bad_pos_inf = torch.isposinf(logprobs).any()
    bad_ids = (valid & ((indices < 0) | (indices >= vocab_size))).any()
    normalized = support in ("tail", "sampled")
    bad_mass = (torch.where(valid, logprobs.float(), 0.0) > 1e-3).any() if normalized else torch.zeros((), dtype=torch.bool)
    bad_threshold = torch.zeros((), dtype=torch.bool)
    if support == "sampled":
        threshold = teacher.log_threshold
        bad_threshold = (torch.isnan(threshold) | torch.isposinf(threshold)).any()
    bad = torch.stack([bad_nan, bad_pos_inf, bad_ids, bad_mass.to(bad_nan.device),
                       bad_threshold.to(bad_nan.device)]).tolist()
    if bad[0]:
        raise ValueError("teacher.logprobs: contains NaN")
    if bad[1]:
        raise ValueError("teacher.logprobs: contains +inf (expected log-probabilities <= 0, -inf for missing entries)")
    if bad[2]:
        raise ValueError(f"teacher.indices: a valid entry lies outside [0, {vocab_size}) (the vocab size V*)")
    if bad[3]:
        raise ValueError(f"teacher.logprobs: entries > 0 in support={support!r} (expected full-vocab "
                         "log-probabilities, not logits)")
    if bad[4]:
        raise ValueError("teacher.log_threshold: contains NaN or +inf (expected the (n+1)-th key less the lse, "
                         "-inf where every column is a sample)")


def without_out_of_range_ids(teacher: TopK, vocab_size: int) -> TopK:
    """The teacher with every entry whose id lies outside [0, V*) made invalid (log-prob -inf):
    what such an entry means when the value checks are off. No host sync; the caller's tensors
    are not modified."""
    indices = teacher.indices
    in_range = (indices >= 0) & (indices < vocab_size)
    logprobs = torch.where(in_range, teacher.logprobs, float("-inf"))
    return dataclasses.replace(teacher, logprobs=logprobs)


def check_labels(labels: Optional[torch.Tensor], num_rows: int, device: torch.device, ce_weight: float) -> None:
    if labels is None:
        if ce_weight != 0:
            raise ValueError(f"labels: required when ce_weight != 0 (got ce_weight={ce_weight}); pass labels or ce_weight=0")
        return
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels: expected an int32 or int64 tensor [N], got {getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != (num_rows,):
        raise ValueError(f"labels: expected shape [{num_rows}] (one label per row, already shifted), got {tuple(labels.shape)}")
    check_same_device("labels", labels, device, "the student tensors")


def check_label_values(labels: Optional[torch.Tensor], ignore_index: int, vocab_size: int) -> None:
    if labels is None:
        return
    bad = ((labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))).any()
    if bad.item():
        raise ValueError(f"labels: a label outside [0, {vocab_size}) that is not ignore_index={ignore_index}")


def check_num_tokens(num_tokens) -> None:
    if num_tokens is None or isinstance(num_tokens, torch.Tensor):
        return
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, float)) or not num_tokens > 0:
        raise ValueError(f"num_tokens: expected None, a positive number or a tensor, got {num_tokens!r}")
