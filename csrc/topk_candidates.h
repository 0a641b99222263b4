// Top-k candidates of logits rows: the CUDA kernel's launcher, free of torch types so the
// kernel compiles (and is checked) with plain nvcc. The pybind11 adapter is bindings.cpp.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace kd_kernels {

enum class LogitsDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Largest k the kernel selects (its shared-memory candidate buffer holds 8 × this).
constexpr int kMaxTopK = 1024;

// For each of `rows` rows of `logits` (row r starts at logits + r * row_stride elements,
// columns contiguous), over its first `width` columns:
//   values [rows, k] float32: the k largest logits / temperature, descending, the lower
//       column first among equal values; -inf past min(k, width);
//   indices [rows, k] int32: their columns (0 past min(k, width));
//   lse [rows] float32: logsumexp(logits[:width] / temperature).
// Requires 1 <= k <= kMaxTopK, 1 <= width < 2^31, temperature > 0.
cudaError_t launch_topk_candidates(LogitsDtype dtype, const void* logits, int64_t rows, int64_t row_stride,
                                   int64_t width, int64_t k, float temperature, float* values, int32_t* indices,
                                   float* lse, cudaStream_t stream);

}  // namespace kd_kernels
