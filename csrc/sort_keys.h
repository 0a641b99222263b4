// Rows of (value, column) keys put in order: the CUDA kernel's launcher, free of torch types.
// The pybind11 adapter is bindings.cpp.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace kd_kernels {

// Most keys per row the kernel sorts (its shared-memory buffer: 8 bytes each).
constexpr int kMaxSortKeys = 4096;

// For each of `rows` rows of `keys` (row r at keys + r * capacity), the first counts[r] keys
// (at most capacity) are (value, column) pairs as the appending matmul stores them
// (kd_kernels/ops/lm_head_group_maxima.py: the float's bits in the high half, the column in the
// low half). Writes
//   values [rows, k] float32: the k largest values, descending, the lower column first among
//       equal values (-0.0 and 0.0 are equal); -inf past counts[r];
//   columns [rows, k] int32: their columns; 0 past counts[r].
// Requires 1 <= k <= capacity <= kMaxSortKeys, 0 <= counts[r] (larger counts read as capacity).
cudaError_t launch_sort_keys(const int64_t* keys, const int32_t* counts, int64_t rows, int64_t capacity, int64_t k,
                             float* values, int32_t* columns, cudaStream_t stream);

}  // namespace kd_kernels
