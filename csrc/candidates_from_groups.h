// The teacher's top-k from its listed groups: the CUDA kernel's launcher, free of torch types.
// The pybind11 adapter is bindings.cpp.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace kd_kernels {

// Columns per group (kd_kernels/ops/lm_head_group_maxima.py's GroupMaximaConfig.group_columns):
// one warp reads one group.
constexpr int kGroupColumns = 32;
// Most candidates per row the kernel gathers (its shared-memory buffer: 8 bytes each).
constexpr int kMaxGroupCandidates = 4096;

// For each of `rows` rows of float32 `logits` (row r at logits + r * row_stride), given the
// ids of its listed groups (group_ids + r * group_capacity, the first min(listed[r],
// group_capacity) of them) and its threshold (thresholds[r]: int32 whose signed order is the
// order of the floats logit * log2e_over_t, -0.0 as 0.0), gathers the columns c < width of
// those groups whose logit * log2e_over_t reaches the threshold and writes
//   values [rows, k] float32: the k largest such logits, descending, the lower column first
//       among equal values; -inf past their count;
//   columns [rows, k] int32: their columns; 0 past their count;
//   overflowed [rows] uint8: 1 where more than key_capacity reached the threshold (the row's
//       other outputs are then meaningless), else 0.
// Requires 1 <= k <= key_capacity <= kMaxGroupCandidates, 0 < width < 2^31.
cudaError_t launch_candidates_from_groups(const float* logits, int64_t row_stride, const int32_t* group_ids,
                                          int64_t group_capacity, const int32_t* listed, const int32_t* thresholds,
                                          int64_t rows, int64_t width, float log2e_over_t, int64_t k,
                                          int64_t key_capacity, float* values, int32_t* columns,
                                          uint8_t* overflowed, cudaStream_t stream);

}  // namespace kd_kernels
