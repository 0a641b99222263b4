"""Evaluation and monitoring during training: held-out CE and KD of the student, throughput,
memory and teacher tail mass (the rows the metrics log writes: `metrics_log`)."""
from __future__ import annotations

import resource
import time
from typing import Optional

import torch

from .fsdp import reshard


def should_evaluate(step: int, every: int, last_step: int) -> bool:
    """Evaluate after ``step`` (1-based count of steps done): every ``every`` steps and at the
    last; never for ``every = 0`` except at the last."""
    if every < 0:
        raise ValueError(f"every: expected >= 0 (0: only at the end), got {every}")
    return step == last_step or (every > 0 and step % every == 0)


@torch.no_grad()
def held_out_losses(student: torch.nn.Module, batches: list, teachers: list, *, attention_masks: Optional[list] = None,
                    group=None) -> dict:
    """Held-out CE and KD of a `DistillationStudent` (sharded or not: every rank of ``group``
    calls it with its own share of the rows, as many batches each). FSDP2 parameters are
    resharded afterwards.

    Args:
        batches: `PackedBatch` es on the student's device.
        teachers: the teacher's `kd.TopK` of each batch.
        attention_masks: each batch's `packing.attention_mask` (None: causal).
        group: the ranks whose sums add up (None: this process alone).
    Returns:
        ``{"held_out_ce": CE per counted token, "held_out_kd": KD per counted token,
        "held_out_tokens": counted tokens}`` over every rank's rows.
    """
    if len(batches) != len(teachers) or (attention_masks is not None and len(attention_masks) != len(batches)):
        raise ValueError(f"batches, teachers, attention_masks: expected one of each per batch, got {len(batches)}, "
                         f"{len(teachers)}, {None if attention_masks is None else len(attention_masks)}")
    was_training = student.training
    student.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    for number, (batch, teacher) in enumerate(zip(batches, teachers)):
        mask = None if attention_masks is None else attention_masks[number]
        _, metrics = student(batch.input_ids, batch.labels, teacher, position_ids=batch.position_ids,
                             attention_mask=mask, reduction="sum")
        sums += torch.stack([metrics["ce_sum"].double().cpu(), metrics["kd_sum"].double().cpu(),
                             metrics["rows"].double().cpu()])
    student.train(was_training)
    reshard(student)
    if group is not None:
        import torch.distributed as dist

        device = next(student.parameters()).device
        reduced = sums.to(device)
        dist.all_reduce(reduced, group=group)
        sums = reduced.cpu()
    ce, kd, tokens = sums.tolist()
    return {"held_out_ce": ce / max(tokens, 1), "held_out_kd": kd / max(tokens, 1), "held_out_tokens": int(tokens)}


def teacher_tail_mass(metrics: dict) -> float:
    """Mean teacher probability outside its top-k over the counted rows, ``1 - teacher_mass_sum / rows``
    (``kd.topk_divergence``'s metrics, summed over micro-batches and ranks)."""
    return 1.0 - float(metrics["teacher_mass_sum"]) / max(float(metrics["rows"]), 1.0)


def memory_mib(device: torch.device) -> dict:
    """This process's peak memory in MiB: ``cuda_max_allocated_mib`` on a CUDA device (since
    the last `torch.cuda.reset_peak_memory_stats`), and always ``peak_rss_mib`` (the resident set
    of the process, CPU memory)."""
    stats = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        stats["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return stats


class Throughput:
    """Tokens per second between calls of `tick`."""

    def __init__(self):
        self._last = time.perf_counter()

    def tick(self, tokens: int) -> float:
        now = time.perf_counter()
        rate = tokens / max(now - self._last, 1e-9)
        self._last = now
        return rate
