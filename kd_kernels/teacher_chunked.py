"""Teacher top-k on the GPU backends: chunks of rows (never the whole ``[N, V]`` logits), per
chunk each row's top-k and its logsumexp. Schedules from hidden:

- the epilogue schedule (`teacher_topk_epilogue`; 16-bit inputs, k ≤ 1024; forced only, the
  default past k = 64 on the triton backend before e37): a Triton matmul
  writes the chunk's float32 logits and, from its accumulator, each row's tile statistics and
  group maxima (ops/lm_head_group_maxima.py); the top-k is then found among the ~k groups
  that can hold it (ops/topk_from_groups.py), without reading the rows back. Rows whose
  candidates overflow (massive ties) are redone at the end by the full-row selection;
- the cuBLAS schedule (`teacher_topk_cublas`; float32 inputs, k > 1024, or forced): cuBLAS
  float32 logits, then a full-row selection, ``select="cuda"``: one CUDA kernel
  (csrc/topk_candidates.cu) that reads each row (once, mostly) and returns the top-k and the
  logsumexp together; ``select="triton"``: two Triton passes (the logsumexp with a threshold
  from the lanes' maxima, then the elements above it) and a sort of the few candidates
  (ops/topk_threshold.py): no compiled extension needed.

The epilogue and cuBLAS schedules hold one chunk's float32 logits (``chunk_rows · V · 4``
bytes, ~1.25 GiB by default). The maxima schedule (`teacher_topk_maxima`; 16-bit inputs, k ≤
256; the default at k ≤ 64 and ``lean=True``'s) stores no logits: the epilogue matmul leaves
each 32-column group's maximum, its column and the group's second largest, which give most of
the top-k directly; the few groups holding two or more top-k elements are computed again.
Its buffers stay within MAXIMA_BYTES whatever N and V. The appended schedule
(`teacher_topk_appended`; 16-bit inputs, k ≤ 1024; the default past k = 64 on both backends)
stores no logits either: floors from a strided sample of the columns, then the epilogue matmul
appends each element reaching its row's floor to the row's keys, one ranking per row: the
extension's sort, or a Triton selection of the k-th key then a sort of k
(ops/topk_from_appended.py, ops/sort_keys.py); within APPENDED_BYTES.
``lean=True`` (`teacher_topk_lean`) stays within ~64 MiB: the default's schedules (maxima up to
k = 64, appended up to k = 1024), else the tiled one
(`teacher_topk_tiled`: tiles of rows × vocab columns, 48 MiB of float32 logits, each slice's
top-k merged into the row chunk's running one). `teacher_topk_fused` writes no logits at all:
the top-k is selected in the epilogue of a Triton matmul (ops/lm_head_topk.py), per vocab
split, and the splits are merged here. (Two more schedules without stored logits were timed and
removed: all ~k listed groups computed again, 2.1× at k = 1024, and vocab slices of row chunks
with a running k-th value, 1.31× at k = 64 and 1.61× at k = 256; benchmarks/NOTES.md.)
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

from .lm_head import lm_head_logits_fp32
from .reference import top_of_candidates
from .topk import TopK

DEFAULT_CHUNK_BYTES = 5 << 28  # 1.25 GiB of float32 logits per chunk
LEAN_SLICE_BYTES = 48 << 20  # float32 logits of one lean tile
LEAN_MERGE_BYTES = 16 << 20  # the lean merge's buffers, about
LEAN_MAX_ROWS = 1024
EPILOGUE_ROW_MULTIPLE = 1024  # the epilogue matmul's L2 group of row tiles (8 × 128 rows)
# the maxima schedule: a chunk's summaries with group top-2, candidate keys and recomputed groups
MAXIMA_BYTES = 56 << 20
MAXIMA_MAX_K = 256
MAXIMA_DEFAULT_K = 64  # the default schedule up to here (H200: the appended and epilogue ones are faster at k = 256)
# the appended schedule: a chunk's sample logits or keys (the same bytes), tile statistics, the sort's outputs
APPENDED_BYTES = 56 << 20
APPENDED_MAX_K = 1024  # the keys' slots (~1.5 · r · stride a row) stay within the extension sort's 4096


def _cuda_candidates(logits: torch.Tensor, k: int, temperature: float, width: int, column_start: int):
    from .ops.topk_candidates import topk_candidates

    values, columns, lse_tempered = topk_candidates(logits, k, temperature, width)
    return values, columns.long() + column_start, lse_tempered


def _chunk_candidates(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, temperature: float, width: int,
                      column_start: int = 0, select: str = "triton"):
    """Top-k candidates of the first ``width`` columns of a logits chunk: tempered values
    ``[R, k]`` float32 (-inf / id 0 past ``width``), int64 global ids, and lse ``[R]``."""
    if select == "cuda":
        if bias is not None:  # the chunk is our own float32 buffer: add in place
            logits[:, :width] += bias[:width].float()
        return _cuda_candidates(logits, k, temperature, width, column_start)
    from .ops.topk_threshold import threshold_topk

    existing = logits[:, :width]
    if bias is not None:
        existing = existing.float() + bias[:width].float()
    values, columns, lse_tempered = threshold_topk(existing, k, temperature, width)
    return values, columns + column_start, lse_tempered


def _outputs(num_rows: int, k: int, device, with_overflow: bool = False) -> tuple[torch.Tensor, ...]:
    """Empty tempered values ``[N, k]`` float32, ids ``[N, k]`` int32 (ids < 2^31), lse ``[N]``
    and, ``with_overflow``, the rows-to-redo mask ``[N]`` bool."""
    outputs = (torch.empty(num_rows, k, dtype=torch.float32, device=device),
               torch.empty(num_rows, k, dtype=torch.int32, device=device),
               torch.empty(num_rows, dtype=torch.float32, device=device))
    return outputs + (torch.empty(num_rows, dtype=torch.bool, device=device),) if with_overflow else outputs


def _logprobs_(values: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor):
    """Tempered values ``[R, k]`` minus their rows' logsumexp ``lse [R]``, in place, and the ids
    ``[R, k]`` of the -inf (missing) entries set to 0 in place; a row without a finite column
    (lse = -inf) keeps -inf entries, not NaN. Returns (values, indices)."""
    values.sub_(torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    return values, indices.masked_fill_(torch.isneginf(values), 0)


def _finish(values, indices, lse_tempered, k, temperature, shard) -> TopK:
    """`TopK` from tempered values ``[N, k]`` float32 (turned into log-probs in place: no copy
    of N·k) and int32 ids."""
    if shard is None:
        values, indices = _logprobs_(values, indices, lse_tempered)
        return TopK(values, indices.to(torch.int32), lse_tempered, temperature)
    from .vocab_parallel import merge_teacher_candidates

    return merge_teacher_candidates(values, indices, lse_tempered, k, temperature, shard)


def teacher_topk_from_logits(logits: torch.Tensor, k: int, temperature: float, vocab_size: int, shard=None,
                             select: str = "triton") -> TopK:
    """logits ``[N, V]`` (bf16 / fp16 / fp32, read in place; this rank's shard under
    ``shard``) -> `TopK` float32."""
    width, column_start = (vocab_size, 0) if shard is None else (shard.existing, shard.vocab_start)
    candidates = _chunk_candidates(logits, None, k, temperature, width, column_start, select)
    return _finish(*candidates, k, temperature, shard)


def teacher_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                 bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                 select: str = "triton") -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` (this rank's shard under ``shard``) -> `TopK`
    float32, chunk by chunk of rows: through the epilogue matmul where it applies
    (`teacher_schedule`), else cuBLAS float32 logits and a full-row selection."""
    schedule = teacher_schedule(hidden, weight, k)
    if schedule == "epilogue":
        return teacher_topk_epilogue(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)
    if schedule == "maxima":
        return teacher_topk_maxima(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)
    if schedule == "appended":
        return teacher_topk_appended(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)
    return teacher_topk_cublas(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)


def teacher_schedule(hidden: torch.Tensor, weight: torch.Tensor, k: int) -> str:
    """For 16-bit TMA-aligned inputs, none of which stores a chunk's logits, on either backend:
    "maxima" for k <= MAXIMA_DEFAULT_K (each 32-column group's top-2 from the epilogue matmul,
    ~50 MiB beyond the outputs at 8192 rows); past it "appended" for k <= APPENDED_MAX_K (floors
    from a sample, the epilogue matmul appends what reaches them, one ranking a row: within 56
    MiB). H200, k = 1024, in blocks: with the extension's sort 1.17-1.24x the matmul against the
    "epilogue" schedule's 1.18-1.24x over two runs (1.25-1.40x in turn against 1.32-1.41x); on the
    triton backend (`_select_then_sort_kernel`) 1.35 / 1.18x against 1.45 / 1.28x, at k = 256
    1.18 / 1.16x against 1.14 / 1.14x (in turn 1.38 / 1.41x against 1.23 / 1.33x; Qwen- /
    Llama-like; NOTES e37), at 48-55 MiB against 1.05-1.38 GiB. Else "cublas".
    ``KD_KERNELS_TEACHER_SCHEDULE=cublas`` / ``=epilogue`` / ``=maxima`` / ``=appended`` forces
    one (the benchmark's A/B; "epilogue" stores a chunk's float32 logits, ~1.25 GiB, then reads
    ~k groups a row); the epilogue-matmul schedules where that matmul does not apply (dtype,
    alignment) are an error."""
    from .ops.lm_head_group_maxima import epilogue_applies

    forced = os.environ.get("KD_KERNELS_TEACHER_SCHEDULE", "")
    if forced not in ("", "epilogue", "maxima", "appended", "cublas"):
        raise ValueError("KD_KERNELS_TEACHER_SCHEDULE: expected 'epilogue', 'maxima', 'appended' or 'cublas', "
                         f"got {forced!r}")
    applies = epilogue_applies(hidden, weight)
    if forced in ("epilogue", "maxima", "appended") and not applies:
        raise ValueError(f"KD_KERNELS_TEACHER_SCHEDULE={forced}: needs bf16 / fp16 hidden and weight with rows at "
                         f"16-byte boundaries; got {hidden.dtype} / {weight.dtype}, hidden size {hidden.shape[1]}")
    if forced:
        return forced
    if applies and k <= MAXIMA_DEFAULT_K:
        return "maxima"
    return "appended" if applies and k <= APPENDED_MAX_K else "cublas"


def _chunk_rows(chunk_rows: Optional[int], num_rows: int, columns: int) -> int:
    return chunk_rows or max(1, min(num_rows, DEFAULT_CHUNK_BYTES // (4 * columns)))


def teacher_topk_epilogue(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                          bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                          select: str = "triton") -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` 16-bit -> `TopK` float32. Per chunk of rows one
    Triton matmul writes the float32 logits and each row's tile statistics and group maxima
    (ops/lm_head_group_maxima.py); the top-k is then found among ~k groups of each row
    (ops/topk_from_groups.py). Rows whose candidates overflow (massive ties) are redone at the
    end by the full-row selection ``select``."""
    from .ops.lm_head_group_maxima import lm_head_logits_with_summaries, padded_width
    from .ops.topk_from_groups import topk_from_group_maxima

    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    if chunk_rows is None:
        chunk_rows = _chunk_rows(None, num_rows, width)
        if chunk_rows < num_rows:  # whole L2 groups of row tiles: 2207-row chunks cost 3-10 % more than 2048 (H200)
            chunk_rows = max(EPILOGUE_ROW_MULTIPLE, chunk_rows // EPILOGUE_ROW_MULTIPLE * EPILOGUE_ROW_MULTIPLE)
    logits = torch.empty(min(chunk_rows, num_rows), padded_width(width), dtype=torch.float32, device=hidden.device)
    values, indices, lse, overflow = _outputs(num_rows, k, hidden.device, with_overflow=True)
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        chunk = logits[:stop - start]
        summaries = lm_head_logits_with_summaries(hidden[start:stop], weight, bias, width, temperature, chunk)
        values[start:stop], indices[start:stop], lse[start:stop], overflow[start:stop] = topk_from_group_maxima(
            chunk, summaries, k, temperature, width, order="cuda" if select == "cuda" else "torch")
    logits = chunk = None  # a redo's logits can take their place
    return _finish_with_redo(overflow, hidden, weight, k, temperature, width, bias, chunk_rows, select,
                             (values, indices, lse), shard)


def _rows_in_quarter_groups(rows: int, num_rows: int) -> int:
    """``rows`` (what a chunk's buffers hold) as whole quarters of the epilogue matmul's L2 group
    of row tiles (at least one quarter), or all ``num_rows`` where they fit."""
    quarter = EPILOGUE_ROW_MULTIPLE // 4
    return num_rows if rows >= num_rows else max(quarter, rows // quarter * quarter)


def maxima_chunk_rows(num_rows: int, width: int, k: int, group_columns: int = 32, tile_columns: int = 256) -> int:
    """Rows per chunk of the maxima schedule: its buffers within MAXIMA_BYTES, in quarters of the
    matmul's L2 group of row tiles. A row holds its tile statistics (8 · V / tile_columns bytes:
    256-column tiles of the Triton matmul, 128 of the Hopper ping-pong one), each group's maximum,
    column and second largest (9 · V / group_columns) and 12 bytes per candidate slot
    (capacity_for(k): keys, group ids)."""
    from .ops.topk_from_groups import capacity_for

    per_row = 8 * width // tile_columns + 9 * width // group_columns + 12 * capacity_for(k)
    return _rows_in_quarter_groups(MAXIMA_BYTES // per_row, num_rows)


def teacher_topk_maxima(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                        bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                        select: str = "triton") -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` 16-bit -> `TopK` float32 without storing logits and
    within MAXIMA_BYTES whatever N (k <= MAXIMA_MAX_K): per chunk of rows the Triton matmul
    leaves each row's tile statistics and each group's maximum, its column and the group's
    second largest (ops/lm_head_group_maxima.py, ``group_top2``); then one program per row
    (ops/topk_from_group_top2.py): groups whose maximum reaches the row's k-th largest group
    maximum T and whose second does not give one key each, the maximum itself; the few whose
    second reaches T too are computed again from hidden × weight and their elements ≥ T join
    the keys. Rows that overflow (massive ties) are redone by cuBLAS logits and the full-row
    selection ``select``."""
    from .ops import lm_head_group_top2_hopper as hopper
    from .ops.lm_head_group_maxima import default_config, lm_head_logits_with_summaries
    from .ops.topk_from_group_top2 import topk_from_group_top2

    if not 1 <= k <= MAXIMA_MAX_K:
        raise ValueError(f"k: the maxima schedule takes 1 <= k <= {MAXIMA_MAX_K}, got {k}")
    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    # the group top-2 matmul, chosen once a call (KD_KERNELS_TOP2_MATMUL)
    if hopper.top2_matmul_choice(hidden, weight) == "pingpong":
        summarize, tile_columns = hopper.group_top2_summaries, hopper.BLOCK_N
    else:
        summarize = functools.partial(lm_head_logits_with_summaries, logits=None, group_top2=True)
        tile_columns = default_config().block_n
    chunk_rows = chunk_rows or maxima_chunk_rows(num_rows, width, k, default_config().group_columns, tile_columns)
    values, indices, lse, overflow = _outputs(num_rows, k, hidden.device, with_overflow=True)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        summaries = summarize(hidden[rows], weight, bias, width, temperature)
        topk_from_group_top2(hidden[rows], weight, bias, summaries, k, temperature, width,
                             (values[rows], indices[rows], lse[rows], overflow[rows]),
                             order="cuda" if select == "cuda" else "torch")
        summaries = None  # freed before the next chunk's are made
    values.div_(temperature)
    return _finish_with_redo(overflow, hidden, weight, k, temperature, width, bias,
                             max(1, MAXIMA_BYTES // (4 * weight.shape[0])), select, (values, indices, lse), shard)


def appended_chunk_rows(num_rows: int, width: int, k: int, plan, element_size: int = 2,
                        block_n: int = 256) -> int:
    """Rows per chunk of the appended schedule (`AppendedPlan` ``plan``): its buffers within
    APPENDED_BYTES, in quarters of the matmul's L2 group of row tiles. A row holds its sample
    logits, then in the same bytes its keys (``max(element_size · sample_columns, 8 ·
    capacity)``), its tile statistics (8 · V / block_n), its floor and count, and the sort's
    values and columns (8 · k)."""
    per_row = (max(element_size * plan.sample_columns, 8 * plan.capacity) + 8 * -(-width // block_n) + 8
               + 8 * k)
    return _rows_in_quarter_groups(APPENDED_BYTES // per_row, num_rows)


def teacher_topk_appended(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                          bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                          select: str = "triton", stride: Optional[int] = None) -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` 16-bit -> `TopK` float32 without storing logits and
    within APPENDED_BYTES whatever N and V (k <= APPENDED_MAX_K): per chunk of rows
    (`_appended_chunk`), the logits of every ``stride``-th column (None: `appended_plan`'s) give
    each row a floor, the epilogue matmul appends each element at or above it to the row's keys
    and keeps the tile statistics (the logsumexp), one sort per row ranks the keys
    (ops/topk_from_appended.py). Rows with fewer than k keys or more than the slots are redone
    by cuBLAS logits and the full-row selection ``select``."""
    from .ops.lm_head_group_maxima import default_config
    from .ops.topk_from_appended import appended_plan

    if not 1 <= k <= APPENDED_MAX_K:
        raise ValueError(f"k: the appended schedule takes 1 <= k <= {APPENDED_MAX_K}, got {k}")
    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    plan = appended_plan(width, k, stride)
    chunk_rows = chunk_rows or appended_chunk_rows(num_rows, width, k, plan, hidden.element_size(),
                                                   default_config().block_n)
    sample_bias = None if bias is None else bias[:width:plan.stride].contiguous()
    values, indices, lse, overflow = _outputs(num_rows, k, hidden.device, with_overflow=True)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        _appended_chunk(hidden[rows], weight, bias, sample_bias, width, k, temperature, plan, select,
                        (values[rows], indices[rows], lse[rows], overflow[rows]))
    # redone rows (rare) in chunks of half the budget
    return _finish_with_redo(overflow, hidden, weight, k, temperature, width, bias,
                             max(1, APPENDED_BYTES // (8 * weight.shape[0])), select, (values, indices, lse), shard)


def _appended_chunk(part: torch.Tensor, weight: torch.Tensor, bias, sample_bias, width: int, k: int,
                    temperature: float, plan, select: str, outputs) -> None:
    """One chunk of `teacher_topk_appended`: rows ``part [R, H]`` -> ``outputs`` (its rows of the
    tempered values, local ids, lse and overflow) filled. Its buffers live only within this call,
    so the next chunk's never coexist with them."""
    from .ops.buffers import empty_parts
    from .ops.lm_head_group_maxima import Appends, EpilogueMatmul
    from .ops.topk_from_appended import rank_appended, sample_floors, tile_logsumexp

    chunk, device = part.shape[0], part.device
    sample_bytes = part.element_size() * plan.sample_columns
    # the sample's logits, in the inputs' dtype (they only bound the floors), then the keys in the same bytes
    shared, floors, counts = empty_parts(device, ((max(sample_bytes, 8 * plan.capacity) * chunk,), torch.uint8),
                                         ((chunk,), torch.float32), ((chunk,), torch.int32))
    sample = shared[:sample_bytes * chunk].view(part.dtype).view(chunk, plan.sample_columns)
    keys = shared[:8 * plan.capacity * chunk].view(torch.int64).view(chunk, plan.capacity)
    # both matmuls set up before the first launch (made between them, a profile showed the device idle ~0.5 ms)
    sampler = EpilogueMatmul(part, weight[:width:plan.stride], sample_bias, plan.sample_width, temperature, sample)
    appender = EpilogueMatmul(part, weight, bias, width, temperature, None, appends=Appends(floors, keys, counts))
    sampler(0, plan.sample_width)
    sample_floors(sample[:, :plan.sample_width], plan.rank, floors)
    counts.zero_()
    summaries = appender(0, width)
    values, indices, lse, overflow = outputs
    tile_logsumexp(summaries.tile_max2, summaries.tile_sum2, lse)
    chunk_values, indices[:], overflow[:] = rank_appended(keys, counts, k, select)
    values.copy_(chunk_values.div_(temperature))


def _finish_with_redo(overflow: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float,
                      width: int, bias: Optional[torch.Tensor], chunk_rows: int, select: str, outputs,
                      shard) -> TopK:
    """`_finish` of ``outputs`` = (tempered values, local ids, lse) with the rows ``overflow``
    marks redone (`_redo_rows`). Unsharded (local ids are the global ones), the log-probs are
    made first and the overflow test is the call's last launch and one host sync: a sync
    followed by launches left the device idle ~0.3 ms a call on an H200 (`nonzero` syncs twice,
    then the finishing ops wait for the host; `benchmarks/profile_teacher.py`, NOTES e25)."""
    values, indices, lse = outputs
    if shard is not None:
        _redo_rows(overflow, hidden, weight, k, temperature, width, bias, chunk_rows, select, outputs)
        return _finish(values, indices.add_(shard.vocab_start), lse, k, temperature, shard)
    _logprobs_(values, indices, lse)
    if bool(overflow.any()):
        rows = _redo_rows(overflow, hidden, weight, k, temperature, width, bias, chunk_rows, select, outputs)
        values[rows], indices[rows] = _logprobs_(values[rows], indices[rows], lse[rows])
    return TopK(values, indices, lse, temperature)


def _redo_rows(overflow: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float,
               width: int, bias: Optional[torch.Tensor], chunk_rows: int, select: str, outputs) -> None:
    """Overwrites ``outputs`` = (tempered values, local ids, lse) at the rows ``overflow`` ``[N]``
    bool marks with the cuBLAS float32 logits and the full-row selection, ``chunk_rows`` rows at
    a time; returns the rows redone (int64). Reading the mask is the schedules' one host sync."""
    rows = overflow.nonzero().flatten()
    if not rows.numel():
        return rows
    values, indices, lse = outputs
    logits = torch.empty(min(chunk_rows, rows.numel()), weight.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, rows.numel(), chunk_rows):
        part = rows[start:start + chunk_rows]
        chunk = lm_head_logits_fp32(hidden[part], weight, logits[:part.numel()])
        part_values, part_ids, part_lse = _chunk_candidates(chunk, bias, k, temperature, width, 0, select)
        values[part], indices[part], lse[part] = part_values, part_ids.to(torch.int32), part_lse
    return rows


def teacher_topk_cublas(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                        bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                        select: str = "triton") -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` (this rank's shard under ``shard``) -> `TopK`
    float32, chunk by chunk of rows: cuBLAS float32 logits, then the full-row selection."""
    num_rows = hidden.shape[0]
    width, column_start = (vocab_size, 0) if shard is None else (shard.existing, shard.vocab_start)
    chunk_rows = _chunk_rows(chunk_rows, num_rows, weight.shape[0])
    logits = torch.empty(min(chunk_rows, num_rows), weight.shape[0], dtype=torch.float32, device=hidden.device)
    values, indices, lse = _outputs(num_rows, k, hidden.device)
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        chunk = lm_head_logits_fp32(hidden[start:stop], weight, logits[:stop - start])
        values[start:stop], indices[start:stop], lse[start:stop] = _chunk_candidates(chunk, bias, k, temperature,
                                                                                     width, column_start, select)
    return _finish(values, indices, lse, k, temperature, shard)


def _merge_running(running, candidates):
    """(values, ids, lse) of the running top-k merged with a later slice's (higher ids)."""
    values, ids = top_of_candidates(torch.cat([running[0], candidates[0]], dim=-1),
                                    torch.cat([running[1], candidates[1]], dim=-1), running[0].shape[-1])
    return values.contiguous(), ids, torch.logaddexp(running[2], candidates[2])


def teacher_topk_lean(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                      bias: Optional[torch.Tensor] = None, shard=None, select: str = "triton") -> TopK:
    """``lean=True``, all within ~64 MiB beyond inputs and outputs: where the epilogue matmul
    takes the inputs, the default's schedules (`teacher_schedule`: `teacher_topk_maxima` up to
    MAXIMA_DEFAULT_K, `teacher_topk_appended` up to APPENDED_MAX_K), on either backend; else
    `teacher_topk_tiled`. On an H200 in blocks (benchmarks/RESULTS.md, 8192 × 4096 × 151,936 /
    16,384 × 4096 × 128,256): k = 256 1.17 / 1.13× the bare matmul appended against 1.39 / 1.34×
    maxima on cuda (`b32a1d2`); k = 1024 1.23 / 1.24× appended against the tiled schedule's
    3.4 / 3.0× on cuda, 1.35 / 1.18× appended on triton (`ab394d7`)."""
    from .ops.lm_head_group_maxima import epilogue_applies

    applies = epilogue_applies(hidden, weight)
    if applies and k <= MAXIMA_DEFAULT_K:
        return teacher_topk_maxima(hidden, weight, k, temperature, vocab_size, bias, None, shard, select)
    if applies and k <= APPENDED_MAX_K:
        return teacher_topk_appended(hidden, weight, k, temperature, vocab_size, bias, None, shard, select)
    return teacher_topk_tiled(hidden, weight, k, temperature, vocab_size, bias, shard, select)


def lean_tile(num_rows: int, k: int) -> tuple[int, int]:
    """(rows, columns) of the lean schedule's tile: rows such that the merge's ``[rows, 2k]``
    buffers stay near 16 MiB (at most 1024), columns such that the float32 tile is 48 MiB
    (32 MiB for k > 256, whose per-tile selection outputs and merge are larger: at k = 1024 the
    48 MiB tile measured ~75 MiB beyond the outputs on an H200). Wide tiles amortize the
    selection's fixed cost per row; short ones bound the merge."""
    rows = max(1, min(num_rows, LEAN_MAX_ROWS, max(128, LEAN_MERGE_BYTES // (40 * k) // 128 * 128)))
    slice_bytes = LEAN_SLICE_BYTES if k <= 256 else LEAN_SLICE_BYTES * 2 // 3
    return rows, max(128, slice_bytes // (4 * rows) // 128 * 128)


def teacher_topk_tiled(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float,
                              vocab_size: int, bias: Optional[torch.Tensor] = None, shard=None, select: str = "triton",
                              tile: Optional[tuple[int, int]] = None) -> TopK:
    """The lean schedule: hidden ``[N, H]``, weight ``[V, H]`` -> `TopK` float32, one tile of
    ``tile = (rows, columns)`` (None: `lean_tile`) at a time: for each chunk of rows, vocab
    slice after vocab slice, each slice's top-k merged into the chunk's running one. Memory
    beyond the outputs: the float32 tile plus the merge's ``[rows, 2k]`` values, ids and order
    (~40 · rows · k bytes), independent of V and N."""
    num_rows = hidden.shape[0]
    width, column_start = (vocab_size, 0) if shard is None else (shard.existing, shard.vocab_start)
    chunk_rows, slice_columns = tile or lean_tile(num_rows, k)
    buffer = torch.empty(min(chunk_rows, num_rows), min(slice_columns, width), dtype=torch.float32,
                         device=hidden.device)
    values, indices, lse = _outputs(num_rows, k, hidden.device)
    for row_start in range(0, num_rows, chunk_rows):
        rows = slice(row_start, min(row_start + chunk_rows, num_rows))
        running = None
        for start in range(0, width, slice_columns):
            stop = min(start + slice_columns, width)
            logits = lm_head_logits_fp32(hidden[rows], weight[start:stop], buffer[:rows.stop - rows.start, :stop - start])
            part_bias = None if bias is None else bias[start:stop]
            candidates = _chunk_candidates(logits, part_bias, k, temperature, stop - start, column_start + start,
                                           select)
            running = candidates if running is None else _merge_running(running, candidates)
        values[rows], indices[rows], lse[rows] = running
    return _finish(values, indices, lse, k, temperature, shard)


def teacher_topk_fused(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                       bias: Optional[torch.Tensor] = None, shard=None) -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` (this rank's shard under ``shard``) -> `TopK`
    float32 with the top-k chosen inside the matmul's epilogue: memory ``N · S · C · 8``
    bytes (S vocab splits, C = next power of two ≥ k + the kernel's column tile), no term in V."""
    from .ops.lm_head_topk import lm_head_topk_splits
    from .ops.sort_keys import top_of_keys, value_column_keys

    width, column_start = (vocab_size, 0) if shard is None else (shard.existing, shard.vocab_start)
    split_values, split_columns, split_max, split_sum = lm_head_topk_splits(hidden.contiguous(), weight.contiguous(),
                                                                            bias, k, temperature, width)
    num_rows = hidden.shape[0]
    values, columns = top_of_keys(value_column_keys(split_values.reshape(num_rows, -1),
                                                    split_columns.reshape(num_rows, -1)), k)
    lse = torch.logsumexp((split_max + torch.log2(split_sum)) * math.log(2.0), dim=-1)
    return _finish(values.contiguous(), columns + column_start, lse, k, temperature, shard)
