"""Teacher Gumbel-top-n samples on the triton backend (docs/DESIGN.md, "Sampled sparse KD"): for
each row, the n largest keys ``κ_v = z_v / τ + G_v`` (G the noise of kd_kernels/sampling.py), their
log-probs over the whole vocab and the (n+1)-th key, chunk by chunk of rows. Two schedules:

- appended (bf16 / fp16 inputs whose rows TMA can move; no logits stored): first, for all rows
  (teacher/floors.py), the logits of every ``stride``-th column give each row a floor, a lower
  bound of a high rank of those columns' keys (ops/topk_from_appended.py's plan for k = n + 1,
  ops/sample_keys.py); then per chunk of rows the sampling matmul (ops/lm_head_sample.py) keeps
  the tile statistics and appends every element that may reach the floor; one ranking per row
  adds the exact noise and takes the n + 1 largest keys. Rows whose floor kept fewer than n + 1
  keys at or above it, or more than the slots, are listed and redone from hidden states by the
  logits schedule's passes on the device (ops/sample_redo.py): no host sync;
- logits (float32 inputs, or other layouts): cuBLAS float32 logits per chunk of rows, then two
  passes over each row (ops/sample_keys.py `logits_candidates`: the logsumexp and each lane's
  largest key, then every key at or above a floor under the (n+1)-th) and the same ranking.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .lm_head import lm_head_logits_fp32
from .ops.buffers import empty_parts
from .ops.lm_head_group_maxima import default_config, epilogue_applies
from .ops.lm_head_sample import SampleAppends, SampleMatmul
from .ops.sample_keys import (logits_candidates, logits_capacity, noise_candidates, rank_noisy_candidates,
                               rank_samples, sample_key_floors)
from .ops.sample_redo import redo_listed_rows
from .ops.topk_from_appended import MAX_KEYS, appended_plan, tile_logsumexp
from .samples import TeacherSamples
from .sampling import seed_key
from .teacher.chunks import APPENDED_BYTES, appended_chunk_rows
from .teacher.floors import floors_of_rows

# the floors kernel holds a row's sample in one power-of-two block: the sample stays within this
# many columns (a sparser stride at large vocabularies) rather than double the block
FLOOR_COLUMNS = 2048
SAMPLE_MAX = 1023  # n + 1 keys within the appended plan's and the rank sort's limits (k <= 1024)
LOGITS_CHUNK_BYTES = 1 << 30  # float32 logits of one chunk of the logits schedule
# a chunk's keys and tile statistics in the appended schedule: 4096 rows at V = 151,936 and n = 16
# (fewer, fuller ranking launches than the top-k's APPENDED_BYTES allows; docs/DECISIONS.md)
SAMPLE_CHUNK_BYTES = 2 * APPENDED_BYTES
RANK_ORDER = "triton"  # how rows rank their candidates: ops/sort_keys.py `top_of_counted_keys`'s order


def _outputs(num_rows: int, num_samples: int, device):
    """Empty (log-probs ``[N, n]`` float32, ids ``[N, n]`` int32, thresholds ``[N]`` float32,
    overflow ``[N]`` bool) and lse ``[N]`` float32; the ``[N]`` parts in one allocation."""
    thresholds, overflow, lse = empty_parts(device, ((num_rows,), torch.float32), ((num_rows,), torch.bool),
                                            ((num_rows,), torch.float32))
    return ((torch.empty(num_rows, num_samples, dtype=torch.float32, device=device),
             torch.empty(num_rows, num_samples, dtype=torch.int32, device=device), thresholds, overflow), lse)


def _logits_rows(logits: torch.Tensor, bias, width: int, num_samples: int, temperature: float, key: int,
                 global_rows, outputs, lse: torch.Tensor) -> None:
    """Rows ``logits [R, ≥ width]`` of the global rows ``global_rows`` (ops/gumbel_noise.py
    `row_operands`: the first one's index, or ``[R]`` int64) -> ``outputs``
    (log-probs, ids, thresholds, overflow: their rows) and ``lse`` filled by the logits schedule."""
    rows, capacity = logits.shape[0], logits_capacity(num_samples)
    keys, counts, floors = empty_parts(logits.device, ((rows, capacity), torch.int64), ((rows,), torch.int32),
                                       ((rows,), torch.float32))
    logits_candidates(logits, bias, width, num_samples, temperature, key, global_rows, keys, counts, floors, lse)
    rank_samples(keys, counts, floors, lse, num_samples, temperature, key, global_rows, RANK_ORDER, outputs)


def _refuse_overflow(overflow: torch.Tensor, op: str) -> None:
    """The logits schedule's rows have no exact redo: one whose candidates overflow (hundreds of
    keys equal in float32) raises. One host sync."""
    if bool(overflow.any()):
        raise RuntimeError(f"{op}: {int(overflow.sum())} rows hold more keys equal in float32 than the candidate "
                           "slots (non-finite or massively tied logits?)")


def _finish(outputs, lse, temperature: float, seed: int) -> TeacherSamples:
    logprobs, ids, thresholds, _ = outputs
    return TeacherSamples(logprobs, ids, thresholds, lse, temperature, seed)


def teacher_sample_from_logits(logits: torch.Tensor, num_samples: int, temperature: float, vocab_size: int,
                               seed: int, row_offset: int = 0) -> TeacherSamples:
    """logits ``[N, ≥ V*]`` (any float dtype, unit stride along a row, read in place) ->
    `TeacherSamples` float32 by the logits schedule, its candidates within APPENDED_BYTES."""
    num_rows = logits.shape[0]
    outputs, lse = _outputs(num_rows, num_samples, logits.device)
    chunk_rows = max(1, APPENDED_BYTES // (8 * logits_capacity(num_samples) + 12))
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, start + chunk_rows)
        _logits_rows(logits[rows], None, vocab_size, num_samples, temperature, seed_key(seed), row_offset + start,
                     tuple(part[rows] for part in outputs), lse[rows])
    _refuse_overflow(outputs[3], "teacher_sample_from_logits")
    return _finish(outputs, lse, temperature, seed)


def teacher_sample(hidden: torch.Tensor, weight: torch.Tensor, num_samples: int, temperature: float, vocab_size: int,
                   bias: Optional[torch.Tensor], seed: int, row_offset: int = 0,
                   chunk_rows: Optional[int] = None) -> TeacherSamples:
    """hidden ``[N, H]``, weight ``[≥ V*, H]`` -> `TeacherSamples` float32: the appended schedule
    where the sampling matmul takes the inputs (16-bit, TMA rows), else the logits schedule."""
    schedule = teacher_sample_appended if epilogue_applies(hidden, weight) else teacher_sample_logits
    return schedule(hidden, weight, num_samples, temperature, vocab_size, bias, seed, row_offset, chunk_rows)


def teacher_sample_logits(hidden: torch.Tensor, weight: torch.Tensor, num_samples: int, temperature: float,
                          vocab_size: int, bias: Optional[torch.Tensor], seed: int, row_offset: int = 0,
                          chunk_rows: Optional[int] = None) -> TeacherSamples:
    """The logits schedule from hidden: cuBLAS float32 logits of ``chunk_rows`` rows at a time
    (None: LOGITS_CHUNK_BYTES worth)."""
    num_rows = hidden.shape[0]
    outputs, lse = _outputs(num_rows, num_samples, hidden.device)
    chunk_rows = chunk_rows or max(1, min(num_rows, LOGITS_CHUNK_BYTES // (4 * weight.shape[0])))
    logits = torch.empty(min(chunk_rows, num_rows), weight.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        chunk = lm_head_logits_fp32(hidden[rows], weight, logits[:rows.stop - start])
        _logits_rows(chunk, bias, vocab_size, num_samples, temperature, seed_key(seed), row_offset + start,
                     tuple(part[rows] for part in outputs), lse[rows])
    _refuse_overflow(outputs[3], "teacher_sample")
    return _finish(outputs, lse, temperature, seed)


def teacher_sample_appended(hidden: torch.Tensor, weight: torch.Tensor, num_samples: int, temperature: float,
                            vocab_size: int, bias: Optional[torch.Tensor], seed: int, row_offset: int = 0,
                            chunk_rows: Optional[int] = None, stride: Optional[int] = None) -> TeacherSamples:
    """The appended schedule (module docstring), ``chunk_rows`` rows at a time (None: within
    SAMPLE_CHUNK_BYTES), every ``stride``-th column sampled for the floors (None: `sample_stride`).
    Rows it cannot finish exactly are redone from hidden states by the logits schedule's passes,
    on the device (ops/sample_redo.py): the call has no host sync."""
    if not 1 <= num_samples <= SAMPLE_MAX:
        raise ValueError(f"num_samples: the appended schedule takes 1 <= n <= {SAMPLE_MAX}, got {num_samples}")
    num_rows = hidden.shape[0]
    if num_rows == 0:
        return _finish(*_outputs(0, num_samples, hidden.device), temperature, seed)
    plan = sample_plan(vocab_size, num_samples, stride)
    key = seed_key(seed)

    def key_floors(sample, rows, floors):
        sample_key_floors(sample, plan.stride, plan.rank, temperature, key, row_offset + rows.start, floors)

    sample_bias = None if bias is None else bias[:vocab_size:plan.stride].contiguous()
    floors = floors_of_rows(hidden, weight, sample_bias, vocab_size, plan, temperature, APPENDED_BYTES, key_floors)
    # the chunk's rows hold their keys and tile statistics (the counts are the call's)
    chunk_rows = min(num_rows, chunk_rows or appended_chunk_rows(num_rows, vocab_size, plan, default_config().block_n,
                                                                 0, SAMPLE_CHUNK_BYTES))
    outputs, lse = _appended_chunks(hidden, weight, bias, vocab_size, num_samples, temperature, plan, key, row_offset,
                                    chunk_rows, floors)
    return _finish(outputs, lse, temperature, seed)


def _appended_chunks(hidden: torch.Tensor, weight: torch.Tensor, bias, width: int, num_samples: int,
                     temperature: float, plan, key: int, row_offset: int, chunk_rows: int, floors: torch.Tensor):
    """The appended schedule's chunks after the floors, then the exact redo of the rows they
    list (ops/sample_redo.py, sized on the device) -> (outputs, lse). No host sync: the host
    launches the next call while this one runs. The outputs are allocated once the first matmul
    is launched; the chunks' keys and tile statistics are freed before the redo's buffers are
    made, and the redo works within the keys' bytes, so the call's peak is the chunks'."""
    num_rows = hidden.shape[0]
    counters, redo_rows = empty_parts(hidden.device, ((num_rows + 1,), torch.int32), ((num_rows,), torch.int32))
    # apart from the counters, which the redo reads: freed before the redo's buffers are made
    keys = torch.empty(chunk_rows, plan.capacity, dtype=torch.int64, device=hidden.device)
    counters.zero_()
    counts, redo_count = counters[:num_rows], counters[num_rows:]  # the rows' appends, the rows to redo
    appender = SampleMatmul(hidden, weight, bias, width, temperature, key, max_rows=chunk_rows)
    outputs = lse = None
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        chunk_keys = keys[:rows.stop - start]
        tile_max2, tile_sum2 = appender(SampleAppends(floors[rows], chunk_keys, counts[rows]), rows, row_offset + start)
        if outputs is None:
            outputs, lse = _outputs(num_rows, num_samples, hidden.device)
        noise_candidates(chunk_keys, counts[rows], floors[rows], num_samples, temperature, key, row_offset + start,
                         outputs[3][rows], (redo_count, redo_rows), start)
        tile_logsumexp(tile_max2, tile_sum2, lse[rows])
        rank_noisy_candidates(chunk_keys, counts[rows], lse[rows], num_samples, key, row_offset + start, RANK_ORDER,
                              tuple(part[rows] for part in outputs[:3]))
    freed = keys.nbytes  # one block the redo's buffers fit in
    del keys, chunk_keys, appender, tile_max2, tile_sum2
    redo_listed_rows(hidden, weight, bias, width, num_samples, temperature, key, row_offset, redo_rows, redo_count,
                     outputs, lse, freed)
    return outputs, lse


@functools.lru_cache(maxsize=64)
def sample_plan(width: int, num_samples: int, stride: Optional[int] = None):
    """The appended schedule's `AppendedPlan` for n samples of ``width`` columns (k = n + 1
    keys), floors from every ``stride``-th column (None: `sample_stride`)."""
    return appended_plan(width, num_samples + 1, stride or sample_stride(width, num_samples))


def sample_stride(width: int, num_samples: int) -> int:
    """The floors' sample stride: the top-k plan's for k = n + 1, or sparser where that sample would
    pass FLOOR_COLUMNS columns and the sparser one keeps the key slots (below the sort's limit,
    so that no more rows pass them)."""
    plan = appended_plan(width, num_samples + 1)
    sparser = appended_plan(width, num_samples + 1, max(plan.stride, -(-width // FLOOR_COLUMNS)))
    return sparser.stride if sparser.capacity <= plan.capacity < MAX_KEYS else plan.stride
