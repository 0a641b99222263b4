"""The tiled schedule (``lean=True`` where the epilogue matmul does not take the inputs): the
teacher's top-k one tile of rows × vocab columns of float32 logits at a time, each slice's
top-k merged into the row chunk's running one: memory independent of N and V."""
from __future__ import annotations

from typing import Optional

import torch

from ..candidates import top_of_candidates
from ..lm_head import lm_head_logits_fp32
from ..topk import TopK
from .chunks import empty_outputs, finish, select_topk

LEAN_SLICE_BYTES = 48 << 20  # float32 logits of one tile
LEAN_MERGE_BYTES = 16 << 20  # the merge's buffers, about
LEAN_MAX_ROWS = 1024


def lean_tile(num_rows: int, k: int) -> tuple[int, int]:
    """(rows, columns) of a tile: rows such that the merge's ``[rows, 2k]`` buffers stay near
    LEAN_MERGE_BYTES (at most LEAN_MAX_ROWS), columns such that the float32 tile is
    LEAN_SLICE_BYTES (two thirds of it for k > 256, whose per-tile selection outputs and merge
    are larger). Wide tiles amortize the selection's fixed cost per row; short ones bound the
    merge."""
    rows = max(1, min(num_rows, LEAN_MAX_ROWS, max(128, LEAN_MERGE_BYTES // (40 * k) // 128 * 128)))
    slice_bytes = LEAN_SLICE_BYTES if k <= 256 else LEAN_SLICE_BYTES * 2 // 3
    return rows, max(128, slice_bytes // (4 * rows) // 128 * 128)


def _merge_running(running, candidates):
    """(values, ids, lse) of the running top-k merged with a later slice's (higher ids)."""
    values, ids = top_of_candidates(torch.cat([running[0], candidates[0]], dim=-1),
                                    torch.cat([running[1], candidates[1]], dim=-1), running[0].shape[-1])
    return values.contiguous(), ids, torch.logaddexp(running[2], candidates[2])


def teacher_topk_tiled(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, vocab_size: int,
                       bias: Optional[torch.Tensor] = None, shard=None, select: str = "triton",
                       tile: Optional[tuple[int, int]] = None) -> TopK:
    """hidden ``[N, H]``, weight ``[V, H]`` (this rank's shard under ``shard``) -> `TopK` float32,
    one tile of ``tile = (rows, columns)`` (None: `lean_tile`) at a time: for each chunk of
    rows, vocab slice after vocab slice, each slice's top-k (the full-row selection ``select``)
    merged into the chunk's running one. Memory beyond the outputs: the float32 tile plus the
    merge's ``[rows, 2k]`` values, ids and order (~40 · rows · k bytes)."""
    num_rows = hidden.shape[0]
    width, column_start = (vocab_size, 0) if shard is None else (shard.existing, shard.vocab_start)
    chunk_rows, slice_columns = tile or lean_tile(num_rows, k)
    buffer = torch.empty(min(chunk_rows, num_rows), min(slice_columns, width), dtype=torch.float32,
                         device=hidden.device)
    values, indices, lse = empty_outputs(num_rows, k, hidden.device)
    for row_start in range(0, num_rows, chunk_rows):
        rows = slice(row_start, min(row_start + chunk_rows, num_rows))
        running = None
        for start in range(0, width, slice_columns):
            stop = min(start + slice_columns, width)
            logits = lm_head_logits_fp32(hidden[rows], weight[start:stop],
                                         buffer[:rows.stop - rows.start, :stop - start])
            part_bias = None if bias is None else bias[start:stop]
            candidates = select_topk(logits, part_bias, k, temperature, stop - start, column_start + start, select)
            running = candidates if running is None else _merge_running(running, candidates)
        values[rows], indices[rows], lse[rows] = running
    return finish(values, indices, lse, k, temperature, shard)
