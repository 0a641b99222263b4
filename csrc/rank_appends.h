// Each row's top-k from the appending matmul's logs: the CUDA kernel's launcher, free of torch
// types. The pybind11 adapter is bindings.cpp.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace kd_kernels {

// Most entries a row gathers (its shared-memory buffer: 8 bytes each); more: the row is flagged.
constexpr int kMaxRankedEntries = 4096;
// Most programs of the appending matmul's grid (one an SM).
constexpr int kMaxRankPrograms = 512;
// An entry's low word: the row tile above kLogColumnBits of column (kd_kernels/ops/lm_head_group_maxima.py).
constexpr int kLogColumnBits = 25;

// The appending matmul (`Appends`) left, for each of `programs` programs and each of `block_m`
// rows of a tile, a log of `log_capacity` entries (logs[(p * block_m + r) * log_capacity + i]:
// the float's bits in the high word, (row tile << kLogColumnBits) | column in the low word),
// log_counts[p * block_m + r] of them written (more: some were lost), and
// row_tiles_seen[p * row_tiles + t] != 0 where program p walked row tile t. Row
// t * block_m + r's elements are the entries tagged t in the logs (p, r) of the programs that
// saw t. For each of `rows` rows writes
//   values [rows, k] float32: its k largest values, descending, the lower column first on ties;
//     -inf past its count;
//   columns [rows, k] int32: their columns; 0 past the count;
//   overflowed [rows] uint8: 1 where the row has fewer than k entries, more than
//     kMaxRankedEntries, or a log of it lost entries (the caller redoes the row).
// Requires 1 <= k <= kMaxRankedEntries, programs <= kMaxRankPrograms.
cudaError_t launch_rank_appends(const int64_t* logs, const int32_t* log_counts, const uint8_t* row_tiles_seen,
                                int64_t programs, int64_t block_m, int64_t log_capacity, int64_t rows, int64_t k,
                                float* values, int32_t* columns, uint8_t* overflowed, cudaStream_t stream);

}  // namespace kd_kernels
