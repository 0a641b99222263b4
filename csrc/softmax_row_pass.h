// The student's row pass in one read of HBM: statistics and dense gradient of float32 logits
// rows, each row held in the shared memory of a cluster of CTAs. Launcher free of torch types
// (plain nvcc compiles and checks it); the pybind11 adapter is bindings.cpp.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "topk_candidates.h"  // LogitsDtype

namespace kd_kernels {

// CTAs that share one row (a thread-block cluster; 8 is the portable maximum).
constexpr int kRowPassCluster = 8;

// Largest row (columns) whose slices fit one CTA's shared memory each.
int64_t softmax_row_pass_max_columns();

// For each of `rows` rows (row r of z = logits[r * row_stride + c] + bias[c], float32, row
// starts 16-byte aligned, row_stride a multiple of 4), over its first `width` columns:
//   lse[r] = logsumexp(z), lse_tempered[r] = logsumexp(z * inv_temperature), best[r] = max z,
//   top1[r] = its lowest column; at_ids[r, j] = z[ids[r, j]] (j < k), at_label[r] = z[labels[r]]
//   (ids / labels: int64 columns < width; either may be null);
// then grad[r * grad_stride + c] = coef[r] * exp(z[c] - lse[r]) for c < width, 0 for
// width <= c < num_columns, in `grad_dtype`. grad may alias logits (the same storage, same
// start): the whole row is in shared memory before any of it is overwritten.
cudaError_t launch_softmax_row_pass(const float* logits, const float* bias, int64_t rows, int64_t row_stride,
                                    int64_t width, int64_t num_columns, float inv_temperature,
                                    const int64_t* ids, int64_t k, int64_t ids_stride, const int64_t* labels,
                                    const float* coef, float* lse, float* lse_tempered, float* best, int64_t* top1,
                                    float* at_ids, int64_t at_ids_stride, float* at_label, LogitsDtype grad_dtype,
                                    void* grad, int64_t grad_stride, cudaStream_t stream);

}  // namespace kd_kernels
