"""Teacher top-k on the GPU backends: chunks of rows (never the whole ``[N, V]`` logits), per
chunk each row's top-k and its logsumexp. Schedules from hidden:

- the epilogue schedule (`teacher_topk_epilogue`; 16-bit inputs, k ≤ 1024): a Triton matmul
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
Its buffers stay within MAXIMA_BYTES whatever N and V. ``lean=True`` (`teacher_topk_lean`)
stays within ~64 MiB: the maxima schedule where it applies, else the tiled one
(`teacher_topk_tiled`: tiles of rows × vocab columns, 48 MiB of float32 logits, each slice's
top-k merged into the row chunk's running one). `teacher_topk_fused` writes no logits at all:
the top-k is selected in the epilogue of a Triton matmul (ops/lm_head_topk.py), per vocab
split, and the splits are merged here. Opt-in, forced by KD_KERNELS_TEACHER_SCHEDULE: the
listed schedule (`teacher_topk_listed`: no logits stored, the listed groups computed again)
and the sliced one (`teacher_topk_sliced`: the epilogue matmul over vocab slices of row chunks,
each row keeping the elements that reach its running k-th value).
"""
from __future__ import annotations

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
EPILOGUE_MAX_K = 1024  # measured up to here; the CUDA sort's 4096 slots per row would hold k <= 2048
EPILOGUE_ROW_MULTIPLE = 1024  # the epilogue matmul's L2 group of row tiles (8 × 128 rows)
# the listed schedule's buffers per chunk: every chunk reads all listed groups' weights again
# (nearly the whole lm_head: 1.2 GB at S1, ~0.26 ms at 4.8 TB/s), so few large chunks (S1: one
# of 8192 rows, 227 MiB measured at k = 64 on an H200) rather than the 64 MiB a chunk of ~1300
# rows would take (1024-row chunks: 30-48 MiB, 1.22-1.33x the matmul against 0.99-1.11x)
LISTED_BYTES = 512 << 20
LISTED_PAIRS_PER_K = 2  # listed groups a row may use on average (k to ~1.5k on LLM logits), times k
# the maxima schedule: a chunk's summaries with group top-2, candidate keys and recomputed groups
MAXIMA_BYTES = 56 << 20
MAXIMA_MAX_K = 256
MAXIMA_DEFAULT_K = 64  # the default schedule up to here (H200: the epilogue schedule is faster at k = 256)
# the sliced schedule: a float32 vocab slice of a chunk of rows and the rows' candidate keys
SLICED_BYTES = 50 << 20
SLICED_MAX_K = 256
RANK_PIECE_BYTES = 8 << 20  # the torch ranking's temporaries at the end of a sliced chunk


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


def _outputs(num_rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty tempered values ``[N, k]`` float32, ids ``[N, k]`` int32 (ids < 2^31) and lse ``[N]``."""
    return (torch.empty(num_rows, k, dtype=torch.float32, device=device),
            torch.empty(num_rows, k, dtype=torch.int32, device=device),
            torch.empty(num_rows, dtype=torch.float32, device=device))


def _finish(values, indices, lse_tempered, k, temperature, shard) -> TopK:
    """`TopK` from tempered values ``[N, k]`` float32 (turned into log-probs in place: no copy
    of N·k) and int32 ids."""
    if shard is None:
        return TopK(values.sub_(lse_tempered.unsqueeze(-1)), indices.to(torch.int32), lse_tempered, temperature)
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
    if schedule == "listed":
        return teacher_topk_listed(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)
    if schedule == "sliced":
        if chunk_rows is not None:
            raise ValueError(f"chunk_rows: the sliced schedule sizes its own tiles (sliced_tile); got {chunk_rows}")
        return teacher_topk_sliced(hidden, weight, k, temperature, vocab_size, bias, shard, select)
    return teacher_topk_cublas(hidden, weight, k, temperature, vocab_size, bias, chunk_rows, shard, select)


def teacher_schedule(hidden: torch.Tensor, weight: torch.Tensor, k: int) -> str:
    """For 16-bit TMA-aligned inputs: "maxima" for k <= MAXIMA_DEFAULT_K (no logits stored,
    ~50 MiB beyond the outputs at 8192 rows against ~1.25 GiB for "epilogue", at the same speed
    within the runs' spread before its epilogue lost its shuffles: H200 k = 64 1.04-1.10x the
    matmul in blocks, 1.21-1.31x in turn, against 1.01-1.10x / 1.19-1.27x over three runs; 1.08x
    / 1.15-1.22x after; slower at k = 256, 1.27-1.35x against 1.07-1.16x), "epilogue" (the
    Triton matmul that also stores the float32 logits and summarizes each row, then ~k groups
    read per row) for k <= EPILOGUE_MAX_K, else "cublas" (at k = 1024 with the candidates
    gathered and sorted by the extension 1.15-1.23x the matmul against 1.25-1.34x for cuBLAS +
    the full-row selection in the same runs; benchmarks/RESULTS.md).
    ``KD_KERNELS_TEACHER_SCHEDULE=cublas`` / ``=epilogue`` / ``=maxima`` / ``=listed`` /
    ``=sliced`` force one (A/B in the benchmark; "listed", `teacher_topk_listed`, is not chosen
    by default: timed no faster, 2.1x at k = 1024; "sliced", `teacher_topk_sliced`, stays within
    ~64 MiB at 1.18-1.40x at k <= 64, lean=True's schedule before the maxima one); the
    epilogue-matmul schedules where that matmul does not apply (dtype, alignment) are an error."""
    from .ops.lm_head_group_maxima import epilogue_applies

    forced = os.environ.get("KD_KERNELS_TEACHER_SCHEDULE", "")
    if forced not in ("", "epilogue", "maxima", "listed", "sliced", "cublas"):
        raise ValueError("KD_KERNELS_TEACHER_SCHEDULE: expected 'epilogue', 'maxima', 'listed', 'sliced' or "
                         f"'cublas', got {forced!r}")
    applies = epilogue_applies(hidden, weight)
    if forced in ("epilogue", "maxima", "listed", "sliced") and not applies:
        raise ValueError(f"KD_KERNELS_TEACHER_SCHEDULE={forced}: needs bf16 / fp16 hidden and weight with rows at "
                         f"16-byte boundaries; got {hidden.dtype} / {weight.dtype}, hidden size {hidden.shape[1]}")
    if forced:
        return forced
    if applies and k <= MAXIMA_DEFAULT_K:
        return "maxima"
    return "epilogue" if applies and k <= EPILOGUE_MAX_K else "cublas"


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
    values, indices, lse = _outputs(num_rows, k, hidden.device)
    overflow = torch.empty(num_rows, dtype=torch.bool, device=hidden.device)
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        chunk = logits[:stop - start]
        summaries = lm_head_logits_with_summaries(hidden[start:stop], weight, bias, width, temperature, chunk)
        values[start:stop], indices[start:stop], lse[start:stop], overflow[start:stop] = topk_from_group_maxima(
            chunk, summaries, k, temperature, width, order="cuda" if select == "cuda" else "torch")
    logits = chunk = None  # a redo's logits can take their place
    return _finish_with_redo(overflow, hidden, weight, k, temperature, width, bias, chunk_rows, select,
                             (values, indices, lse), shard)


def listed_chunk_rows(num_rows: int, width: int, k: int, group_columns: int = 32) -> int:
    """Rows per chunk of the listed schedule: its buffers within LISTED_BYTES, in quarters of the
    matmul's L2 group of row tiles. A row holds its group maxima (4 · V / group_columns bytes),
    tile statistics (8 · V / 256), 28 bytes per listed-group slot (capacity_for(k) slots:
    ids, ranks, the plan's rows and destinations, the selection's keys) and the recomputed
    logits (4 · group_columns per pair)."""
    from .ops.topk_from_groups import capacity_for

    per_row = (4 * width // group_columns + 8 * width // 256 + 28 * capacity_for(k)
               + 4 * group_columns * LISTED_PAIRS_PER_K * k)
    return _rows_in_quarter_groups(LISTED_BYTES // per_row, num_rows)


def _rows_in_quarter_groups(rows: int, num_rows: int) -> int:
    """``rows`` (what a chunk's buffers hold) as whole quarters of the epilogue matmul's L2 group
    of row tiles (at least one quarter), or all ``num_rows`` where they fit."""
    quarter = EPILOGUE_ROW_MULTIPLE // 4
    return num_rows if rows >= num_rows else max(quarter, rows // quarter * quarter)


def teacher_topk_listed(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                        bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None, shard=None,
                        select: str = "triton") -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` 16-bit -> `TopK` float32 without storing logits:
    per chunk of rows the Triton matmul leaves only each row's tile statistics and group
    maxima (ops/lm_head_group_maxima.py, ``logits=None``); the groups that can hold the top-k
    are listed (ops/topk_from_groups.list_groups), their logits computed again from hidden ×
    weight (ops/listed_group_logits.py, ~k · 32 columns a row) and the top-k taken among them
    (ops/topk_of_listed.py). Memory beyond the outputs: ``listed_chunk_rows`` keeps it under
    LISTED_BYTES whatever N (``chunk_rows`` sets it: by that estimate ~47 KB a row at
    V = 151,936, k = 64). Rows that overflow (massive ties, more listed groups than the budget)
    are redone by cuBLAS logits and the full-row selection ``select``."""
    from .ops.listed_group_logits import listed_group_logits, plan_pairs
    from .ops.lm_head_group_maxima import default_config, lm_head_logits_with_summaries
    from .ops.topk_from_groups import list_groups
    from .ops.topk_of_listed import topk_of_listed

    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    group_columns = default_config().group_columns
    chunk_rows = chunk_rows or listed_chunk_rows(num_rows, width, k, group_columns)
    values, indices, lse = _outputs(num_rows, k, hidden.device)
    overflow = torch.empty(num_rows, dtype=torch.bool, device=hidden.device)
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        part = hidden[start:stop]
        summaries = lm_head_logits_with_summaries(part, weight, bias, width, temperature, None)
        lse[start:stop], thresholds, group_ids, listed, group_counts, ranks = list_groups(summaries, k, temperature)
        plan = plan_pairs(group_ids, listed, group_counts, ranks, LISTED_PAIRS_PER_K * k * (stop - start))
        del summaries  # the group maxima's bytes go to the recomputed logits
        group_logits = listed_group_logits(part, weight, bias, width, plan, group_columns)
        chunk_values, indices[start:stop], chunk_overflow = topk_of_listed(
            group_logits, plan.offsets, group_ids, listed, thresholds, k, width,
            order="cuda" if select == "cuda" else "torch")
        values[start:stop] = chunk_values.div_(temperature)
        overflow[start:stop] = chunk_overflow | plan.overflow
    return _finish_with_redo(overflow, hidden, weight, k, temperature, width, bias, chunk_rows, select,
                             (values, indices, lse), shard)


def maxima_chunk_rows(num_rows: int, width: int, k: int, group_columns: int = 32) -> int:
    """Rows per chunk of the maxima schedule: its buffers within MAXIMA_BYTES, in quarters of the
    matmul's L2 group of row tiles. A row holds its tile statistics (8 · V / 256 bytes), each
    group's maximum, column and second largest (9 · V / group_columns) and 12 bytes per
    candidate slot (capacity_for(k): keys, group ids)."""
    from .ops.topk_from_groups import capacity_for

    per_row = 8 * width // 256 + 9 * width // group_columns + 12 * capacity_for(k)
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
    from .ops.lm_head_group_maxima import default_config, lm_head_logits_with_summaries
    from .ops.topk_from_group_top2 import topk_from_group_top2

    if not 1 <= k <= MAXIMA_MAX_K:
        raise ValueError(f"k: the maxima schedule takes 1 <= k <= {MAXIMA_MAX_K}, got {k}")
    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    chunk_rows = chunk_rows or maxima_chunk_rows(num_rows, width, k, default_config().group_columns)
    values, indices, lse = _outputs(num_rows, k, hidden.device)
    overflow = torch.empty(num_rows, dtype=torch.bool, device=hidden.device)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        summaries = lm_head_logits_with_summaries(hidden[rows], weight, bias, width, temperature, None,
                                                  group_top2=True)
        topk_from_group_top2(hidden[rows], weight, bias, summaries, k, temperature, width,
                             (values[rows], indices[rows], lse[rows], overflow[rows]),
                             order="cuda" if select == "cuda" else "torch")
        summaries = None  # freed before the next chunk's are made
    values.div_(temperature)
    return _finish_with_redo(overflow, hidden, weight, k, temperature, width, bias,
                             max(1, MAXIMA_BYTES // (4 * weight.shape[0])), select, (values, indices, lse), shard)


def sliced_tile(num_rows: int, k: int, multiprocessors: Optional[int] = None,
                width: Optional[int] = None) -> tuple[int, int]:
    """(rows, columns) of the sliced schedule: slices of whole 256-column tiles of the epilogue
    matmul, as many rows as the float32 slice and the rows' keys fit in SLICED_BYTES (at most
    4096), with ``multiprocessors`` fitted so each slice's tiles fill ≥ 95 % of their waves
    (3072 columns). With the vocab ``width`` too: of 3072- and 4096-column slices so fitted, the
    one whose whole call takes the fewest waves of tiles (then the fewest launches). On an H200
    at 8192 × 151,936: k = 8 4096 × 3072, k = 64 2816 × 3072, k = 256 2048 × 4096 (2560 × 3072
    left a last chunk of 512 rows: 347 waves against 300, the whole schedule 28.0 against 24.9
    ms)."""
    if multiprocessors is None or width is None:
        return _sliced_rows(num_rows, k, 3072, multiprocessors), 3072
    candidates = []
    for columns in (3072, 4096):
        rows = _sliced_rows(num_rows, k, columns, multiprocessors)
        chunks, slices = -(-num_rows // rows), -(-width // columns)
        candidates.append((_tile_waves(num_rows, width, rows, columns, multiprocessors), chunks * slices,
                           rows, columns))
    return min(candidates)[2:]


def _sliced_rows(num_rows: int, k: int, columns: int, multiprocessors: Optional[int]) -> int:
    """Rows of a sliced chunk: what SLICED_BYTES holds (≤ 4096); with ``multiprocessors``, the
    most whole 128-row tiles down to three quarters of that whose slice fills ≥ 95 % of its
    waves of 256-column tiles."""
    from .ops.slice_candidates import slice_key_capacity

    rows = max(1, min(num_rows, 4096, SLICED_BYTES // (4 * columns + 8 * slice_key_capacity(k))))
    if multiprocessors is None or rows == num_rows or rows < 128:
        return rows
    column_tiles, budget = columns // 256, rows // 128

    def wave_use(row_tiles):
        tiles = row_tiles * column_tiles
        return tiles / (-(-tiles // multiprocessors) * multiprocessors)
    fitting = [tiles for tiles in range(budget, (3 * budget) // 4 - 1, -1) if wave_use(tiles) >= 0.95]
    return fitting[0] * 128 if fitting else rows


def _tile_waves(num_rows: int, width: int, rows: int, columns: int, multiprocessors: int) -> int:
    """Waves of 128 × 256 tiles over ``multiprocessors`` the whole call takes in chunks of
    ``rows`` and slices of ``columns`` (the last chunk and slice may be narrower)."""
    def tiles(extent, size):
        return -(-extent // size)
    full_chunks, last_rows = divmod(num_rows, rows)
    full_slices, last_columns = divmod(width, columns)
    waves = 0
    for chunk_count, chunk_rows in ((full_chunks, rows), (1 if last_rows else 0, last_rows)):
        for slice_count, slice_columns in ((full_slices, columns), (1 if last_columns else 0, last_columns)):
            per_slice = tiles(chunk_rows, 128) * tiles(slice_columns, 256)
            waves += chunk_count * slice_count * tiles(per_slice, multiprocessors)
    return waves


def teacher_topk_sliced(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                        bias: Optional[torch.Tensor] = None, shard=None, select: str = "triton",
                        tile: Optional[tuple[int, int]] = None) -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` 16-bit -> `TopK` float32 with a slice buffer and
    keys within SLICED_BYTES whatever N and V (with the slice summaries and the ranking on top,
    41–53 MiB beyond the outputs measured at 8192 rows, k ≤ 256, with the extension; without it
    the torch ranking's ~RANK_PIECE_BYTES on top): per chunk of rows, vocab slice after vocab slice (``tile`` =
    (rows, columns), None: `sliced_tile`), the epilogue matmul writes the slice's float32
    logits and summaries, and each row keeps the slice's elements reaching its running floor
    (ops/slice_candidates.py); one ranking of each row's keys at the end. Rows whose keys
    overflow (massive ties) are redone by cuBLAS logits and the full-row selection."""
    from .ops.lm_head_group_maxima import EpilogueMatmul, padded_width
    from .ops.slice_candidates import SliceState, append_slice_candidates, slice_key_capacity

    if not 1 <= k <= SLICED_MAX_K:
        raise ValueError(f"k: the sliced schedule takes 1 <= k <= {SLICED_MAX_K}, got {k}")
    num_rows = hidden.shape[0]
    width = vocab_size if shard is None else shard.existing
    multiprocessors = (torch.cuda.get_device_properties(hidden.device).multi_processor_count
                       if hidden.device.type == "cuda" else None)
    chunk_rows, slice_columns = tile or sliced_tile(num_rows, k, multiprocessors, width)
    buffer = torch.empty(min(chunk_rows, num_rows), padded_width(min(slice_columns, width)), dtype=torch.float32,
                         device=hidden.device)
    values, indices, lse = _outputs(num_rows, k, hidden.device)
    overflow = torch.empty(num_rows, dtype=torch.bool, device=hidden.device)
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        logits = buffer[:stop - start]
        state = SliceState.empty(stop - start, slice_key_capacity(k), hidden.device)
        slice_logits = EpilogueMatmul(hidden[start:stop], weight, bias, min(slice_columns, width), temperature, logits)
        for slice_start in range(0, width, slice_columns):
            slice_width = min(slice_columns, width - slice_start)
            summaries = slice_logits(slice_start, slice_width)
            append_slice_candidates(logits, summaries, state, slice_width, slice_start, k)
        _rank_chunk_keys(state, k, temperature, select, (values, indices, lse, overflow), slice(start, stop))
        # freed before the next chunk's are made (both alive at once: +20 MiB at k = 256, measured)
        state = slice_logits = summaries = None
    buffer = logits = None  # a redo's logits can take their place
    return _finish_with_redo(overflow, hidden, weight, k, temperature, width, bias,
                             max(1, SLICED_BYTES // (4 * weight.shape[0])), select, (values, indices, lse), shard)


def _rank_chunk_keys(state, k: int, temperature: float, select: str, outputs, rows: slice) -> None:
    """A chunk's `SliceState` -> its rows of ``outputs`` = (tempered values, local ids, lse,
    overflow mask): one ranking of each row's keys, the running logsumexp in natural units."""
    from .ops.sort_keys import top_of_counted_keys

    values, indices, lse, overflow = outputs
    order = "cuda" if select == "cuda" else "torch"
    # a torch sort holds ~3 copies of the keys it ranks (masked keys, sorted values, their order):
    # pieces of rows keep that near RANK_PIECE_BYTES (the extension's sort needs no temporaries)
    piece = state.keys.shape[0] if order == "cuda" else max(1, RANK_PIECE_BYTES // (3 * state.keys[0].nbytes))
    for start in range(0, state.keys.shape[0], piece):
        part = slice(start, start + piece)
        top_values, indices[rows][part] = top_of_counted_keys(state.keys[part], state.counts[part], k, order)
        values[rows][part] = top_values.div_(temperature)
    lse[rows] = (state.max2 + torch.log2(state.sum2)) * math.log(2.0)
    overflow[rows] = state.overflow.bool()


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
    values.sub_(lse.unsqueeze(-1))
    if bool(overflow.any()):
        rows = _redo_rows(overflow, hidden, weight, k, temperature, width, bias, chunk_rows, select, outputs)
        values[rows] = values[rows] - lse[rows].unsqueeze(-1)
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
    """``lean=True``: `teacher_topk_maxima` where the epilogue matmul takes the inputs and k <=
    MAXIMA_MAX_K (on an H200 at 8192 × 4096 × 151,936 in blocks: k = 64 1.04-1.09× the bare
    matmul, k = 256 1.27-1.35×, against 1.31-1.32× and 1.61-1.62× for the sliced schedule that
    was lean=True's before), else `teacher_topk_tiled`; both within ~64 MiB beyond inputs and
    outputs."""
    from .ops.lm_head_group_maxima import epilogue_applies

    if k <= MAXIMA_MAX_K and epilogue_applies(hidden, weight):
        return teacher_topk_maxima(hidden, weight, k, temperature, vocab_size, bias, None, shard, select)
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
