"""What the teacher's schedules share: their outputs, the full-row selection of a chunk of
logits, the finish (log-probs, or the merge over a vocab-parallel group) and the exact redo of
the rows a schedule flags."""
from __future__ import annotations

from typing import Optional

import torch

from ..candidates import logprobs_
from ..distributed import combine_topk
from ..lm_head import lm_head_logits_fp32
from ..topk import TopK

MATMUL_ROW_GROUP = 1024  # the epilogue matmul's L2 group of row tiles (8 × 128 rows)
# an appended schedule's buffers: the floors phase's sample logits, then a chunk's keys, tile
# statistics and what else its rows hold (the samples' chunks take twice this: SAMPLE_CHUNK_BYTES)
APPENDED_BYTES = 56 << 20


def rows_in_quarter_groups(rows: int, num_rows: int) -> int:
    """``rows`` (what a chunk's buffers hold) as whole quarters of the epilogue matmul's L2 group
    of row tiles (at least one quarter: whole groups keep weight tiles reused from L2), or all
    ``num_rows`` where they fit."""
    quarter = MATMUL_ROW_GROUP // 4
    return num_rows if rows >= num_rows else max(quarter, rows // quarter * quarter)


def appended_chunk_rows(num_rows: int, width: int, plan, block_n: int, row_bytes: int,
                        budget_bytes: int = APPENDED_BYTES) -> int:
    """Rows per chunk of an appending matmul (`AppendedPlan` ``plan``): its buffers within
    ``budget_bytes``, in whole quarters of the matmul's L2 row group (`rows_in_quarter_groups`),
    the rows spread evenly over the fewest chunks (8192 rows within 5120 a chunk: two of 4096,
    not 5120 and 3072). A row holds its keys (8 · capacity), its tile statistics
    (8 · V / block_n) and ``row_bytes`` more (the schedule's own)."""
    per_row = 8 * plan.capacity + 8 * -(-width // block_n) + row_bytes
    most = rows_in_quarter_groups(budget_bytes // per_row, num_rows)
    if most >= num_rows:
        return num_rows
    quarter = MATMUL_ROW_GROUP // 4
    even = -(-num_rows // -(-num_rows // most))  # the rows of each of the fewest chunks
    return -(-even // quarter) * quarter  # at most `most`, itself whole quarters


def select_topk(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, temperature: float, width: int,
                column_start: int = 0, select: str = "triton"):
    """The full-row selection of the first ``width`` columns of a logits chunk ``[R, ≥ width]``
    (+ ``bias``): tempered values ``[R, k]`` float32 (-inf / id 0 past ``width``), int64 global
    ids (from ``column_start``), and lse ``[R]``. ``select``: "cuda" (the extension's kernel;
    with a bias, ``logits`` is a float32 buffer of ours, added to in place) or "triton"."""
    if select == "cuda":
        from ..ops.topk_candidates import topk_candidates

        if bias is not None:
            logits[:, :width] += bias[:width].float()
        values, columns, lse_tempered = topk_candidates(logits, k, temperature, width)
        return values, columns.long() + column_start, lse_tempered
    from ..ops.topk_threshold import threshold_topk

    existing = logits[:, :width]
    if bias is not None:
        existing = existing.float() + bias[:width].float()
    values, columns, lse_tempered = threshold_topk(existing, k, temperature, width)
    return values, columns + column_start, lse_tempered


def empty_outputs(num_rows: int, k: int, device, with_overflow: bool = False) -> tuple[torch.Tensor, ...]:
    """Empty tempered values ``[N, k]`` float32, ids ``[N, k]`` int32 (ids < 2^31), lse ``[N]``
    and, ``with_overflow``, the rows-to-redo mask ``[N]`` bool."""
    outputs = (torch.empty(num_rows, k, dtype=torch.float32, device=device),
               torch.empty(num_rows, k, dtype=torch.int32, device=device),
               torch.empty(num_rows, dtype=torch.float32, device=device))
    return outputs + (torch.empty(num_rows, dtype=torch.bool, device=device),) if with_overflow else outputs


def finish(values, indices, lse_tempered, k, temperature, shard) -> TopK:
    """`TopK` from tempered values ``[N, k]`` float32 (turned into log-probs in place: no copy
    of N·k) and ids; under a `VocabShard`, the exact merge of every rank's candidates."""
    if shard is None:
        values, indices = logprobs_(values, indices, lse_tempered)
        return TopK(values, indices.to(torch.int32), lse_tempered, temperature)
    return combine_topk(values, indices, lse_tempered, k, temperature, shard)


def finish_with_redo(overflow: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float,
                     width: int, bias: Optional[torch.Tensor], chunk_rows: int, select: str, outputs,
                     shard) -> TopK:
    """`finish` of ``outputs`` = (tempered values, local ids, lse) with the rows ``overflow``
    marks redone (`redo_rows`). Unsharded (local ids are the global ones), the log-probs are
    made first and the overflow test is the call's last launch and its one host sync: a sync
    followed by launches would leave the device idle while the host catches up."""
    values, indices, lse = outputs
    if shard is not None:
        redo_rows(overflow, hidden, weight, k, temperature, width, bias, chunk_rows, select, outputs)
        return finish(values, indices.add_(shard.vocab_start), lse, k, temperature, shard)
    logprobs_(values, indices, lse)
    if bool(overflow.any()):
        rows = redo_rows(overflow, hidden, weight, k, temperature, width, bias, chunk_rows, select, outputs)
        values[rows], indices[rows] = logprobs_(values[rows], indices[rows], lse[rows])
    return TopK(values, indices, lse, temperature)


def redo_rows(overflow: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float,
              width: int, bias: Optional[torch.Tensor], chunk_rows: int, select: str, outputs) -> torch.Tensor:
    """Overwrites ``outputs`` = (tempered values, local ids, lse) at the rows ``overflow``
    ``[N]`` bool marks with the cuBLAS float32 logits and the full-row selection, ``chunk_rows``
    rows at a time; returns the rows redone (int64). Reading the mask is the schedules' one host
    sync."""
    rows = overflow.nonzero().flatten()
    if not rows.numel():
        return rows
    values, indices, lse = outputs
    logits = torch.empty(min(chunk_rows, rows.numel()), weight.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, rows.numel(), chunk_rows):
        part = rows[start:start + chunk_rows]
        chunk = lm_head_logits_fp32(hidden[part], weight, logits[:part.numel()])
        part_values, part_ids, part_lse = select_topk(chunk, bias, k, temperature, width, 0, select)
        values[part], indices[part], lse[part] = part_values, part_ids.to(torch.int32), part_lse
    return rows
