"""The teacher's top-k on the GPU backends ("cuda", "triton"): chunks of rows, never the whole
``[N, V]`` logits, each row's top-k and its logsumexp. One module per schedule:

- `schedule`: which schedule a call takes (`teacher_schedule`), and ``lean=True``'s choice;
- `maxima` (bf16 / fp16, k ≤ 64): the epilogue matmul leaves each 32-column group's maximum,
  its column and its second largest, which give most of the top-k; the few groups holding
  two or more top-k elements are computed again. No logits stored;
- `appended` (bf16 / fp16, k ≤ 1024): floors from a strided sample of the columns, then the
  epilogue matmul appends every element reaching its row's floor to the row's keys, and one
  ranking per row orders them. No logits stored;
- `logits_rows`: cuBLAS float32 logits a chunk of rows at a time (float32 inputs, k > 1024,
  rows the other schedules flag for a redo), or logits the caller holds, then the full-row
  selection: the CUDA extension's kernel (``select="cuda"``) or a Triton threshold select;
- `tiled` (``lean=True`` where the epilogue matmul does not take the inputs): tiles of rows ×
  vocab columns of float32 logits, each slice's top-k merged into the row chunk's running one;
- `chunks`: what they share (outputs, the full-row selection of a chunk, the finish into
  log-probs or the merge over a vocab-parallel group, the exact redo of flagged rows).

Every schedule is exact: rows whose candidates do not fit (massive ties) are redone by cuBLAS
logits and the full-row selection.
"""
