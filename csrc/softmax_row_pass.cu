// The student's row pass in one read of HBM (see softmax_row_pass.h).
//
// Why a cluster: a float32 row of 151,936 logits is 594 KiB, more than one SM's shared memory,
// and a one-CTA-per-row kernel must read it twice (statistics, then the gradient that needs
// the logsumexp). Eight CTAs of a cluster hold one slice each (74 KiB at that width), exchange
// their partial maximum / sums through distributed shared memory, and write the gradient from
// shared memory: 4 bytes read and 2 written per element instead of 8 read and 2 written.
#include "softmax_row_pass.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>

namespace cg = cooperative_groups;

namespace kd_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;  // 32 KiB of loads in flight per CTA, two CTAs per SM at V = 151,936
// A CTA's slice of the row; static shared memory and the per-block reserve fit beside it.
constexpr int64_t kMaxSliceFloats = (200 * 1024) / 4;

struct Partial {
  float max;           // of the slice (-inf if it holds no existing column)
  float sum;           // sum of exp(z - max)
  float sum_tempered;  // sum of exp((z - max) / temperature)
  int column;          // lowest column holding max
};

__device__ __forceinline__ void keep_larger(float& best, int& column, float other, int other_column) {
  if (other > best || (other == best && other_column < column)) {
    best = other;
    column = other_column;
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* out, float4 v);

template <>
__device__ __forceinline__ void store4<float>(float* out, float4 v) {
  *reinterpret_cast<float4*>(out) = v;
}

template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* out, float4 v) {
  __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
  *reinterpret_cast<uint2*>(out) = *reinterpret_cast<uint2*>(pair);
}

template <>
__device__ __forceinline__ void store4<__half>(__half* out, float4 v) {
  __half2 pair[2] = {__floats2half2_rn(v.x, v.y), __floats2half2_rn(v.z, v.w)};
  *reinterpret_cast<uint2*>(out) = *reinterpret_cast<uint2*>(pair);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ float block_sum(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  __syncthreads();  // scratch may still be read from the previous reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

template <typename GradT>
__global__ void __launch_bounds__(kThreads) softmax_row_pass_kernel(
    const float* __restrict__ logits, const float* __restrict__ bias, int64_t row_stride, int width,
    int num_columns, int slice_len, float inv_temperature, bool tempered, const int64_t* __restrict__ ids, int k,
    int64_t ids_stride, const int64_t* __restrict__ labels, const float* __restrict__ coef, float* lse_out,
    float* lse_tempered_out, float* best_out, int64_t* top1_out, float* at_ids, int64_t at_ids_stride,
    float* at_label, GradT* grad, int64_t grad_stride) {
  extern __shared__ float4 slice4[];
  float* slice = reinterpret_cast<float*>(slice4);
  __shared__ Partial partial;
  __shared__ float scratch[kWarps];
  __shared__ int scratch_column[kWarps];

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / kRowPassCluster;
  const int slice_start = rank * slice_len;
  const int slice_columns = max(0, min(slice_len, num_columns - slice_start));
  const int vectors = slice_columns / 4;
  const float* row_logits = logits + row * row_stride + slice_start;
  const int tid = threadIdx.x;

  // 1. the slice into shared memory (z = logits + bias, -inf past width), max and its column
  float thread_max = -INFINITY;
  int thread_column = INT_MAX;
  for (int base = 0; base < vectors; base += kThreads * kUnroll) {
    float4 loaded[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + tid;
      if (i < vectors) loaded[u] = __ldcs(reinterpret_cast<const float4*>(row_logits) + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + tid;
      if (i >= vectors) continue;
      float z[4] = {loaded[u].x, loaded[u].y, loaded[u].z, loaded[u].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = slice_start + 4 * i + e;
        z[e] = column < width ? z[e] + (bias ? bias[column] : 0.0f) : -INFINITY;
        if (z[e] > thread_max) {  // a thread sees its columns in ascending order: the lowest wins ties
          thread_max = z[e];
          thread_column = column;
        }
      }
      slice4[i] = make_float4(z[0], z[1], z[2], z[3]);
    }
  }
  for (int j = 4 * vectors + tid; j < slice_columns; j += kThreads) {  // a last partial vector
    const int column = slice_start + j;
    const float z = column < width ? row_logits[j] + (bias ? bias[column] : 0.0f) : -INFINITY;
    slice[j] = z;
    if (z > thread_max) {
      thread_max = z;
      thread_column = column;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    keep_larger(thread_max, thread_column, __shfl_xor_sync(0xffffffffu, thread_max, offset),
                __shfl_xor_sync(0xffffffffu, thread_column, offset));
  }
  if (tid % 32 == 0) {
    scratch[tid / 32] = thread_max;
    scratch_column[tid / 32] = thread_column;
  }
  __syncthreads();
  float slice_max = -INFINITY;
  int slice_column = INT_MAX;
  for (int w = 0; w < kWarps; ++w) keep_larger(slice_max, slice_column, scratch[w], scratch_column[w]);

  // 2. the slice's sums, from shared memory (each thread reads back what it wrote)
  const float shift = slice_max == -INFINITY ? 0.0f : slice_max;
  float sum = 0.0f, sum_tempered = 0.0f;
  for (int j = tid; j < slice_columns; j += kThreads) {
    const float z = slice[j];
    sum += __expf(z - shift);
    if (tempered) sum_tempered += __expf((z - shift) * inv_temperature);
  }
  sum = block_sum(sum, scratch);
  if (tempered) sum_tempered = block_sum(sum_tempered, scratch);
  if (tid == 0) partial = Partial{slice_max, sum, sum_tempered, slice_column};

  // 3. the row's statistics from the cluster's partials
  cluster.sync();  // every slice is in shared memory: the row in global memory may be overwritten
  float row_max = -INFINITY;
  int row_column = INT_MAX;
  Partial parts[kRowPassCluster];
#pragma unroll
  for (int r = 0; r < kRowPassCluster; ++r) {
    parts[r] = *cluster.map_shared_rank(&partial, r);
    keep_larger(row_max, row_column, parts[r].max, parts[r].column);
  }
  cluster.barrier_arrive();  // this CTA is done with the others' shared memory
  const float row_shift = row_max == -INFINITY ? 0.0f : row_max;
  float total = 0.0f, total_tempered = 0.0f;
#pragma unroll
  for (int r = 0; r < kRowPassCluster; ++r) {
    total += parts[r].sum * __expf(parts[r].max - row_shift);
    if (tempered) total_tempered += parts[r].sum_tempered * __expf((parts[r].max - row_shift) * inv_temperature);
  }
  const float lse = row_shift + logf(total);
  if (rank == 0 && tid == 0) {
    lse_out[row] = lse;
    lse_tempered_out[row] = tempered ? row_shift * inv_temperature + logf(total_tempered) : lse;
    best_out[row] = row_max;
    top1_out[row] = row_column;
  }
  // the values at the ids and the label this slice holds (ids < width: each in one slice)
  for (int j = tid; j < k; j += kThreads) {
    const int64_t column = ids[row * ids_stride + j] - slice_start;
    if (column >= 0 && column < slice_columns) at_ids[row * at_ids_stride + j] = slice[column];
  }
  if (labels != nullptr && tid == 0) {
    const int64_t column = labels[row] - slice_start;
    if (column >= 0 && column < slice_columns) at_label[row] = slice[column];
  }

  // 4. the dense gradient coef * softmax(z) over the slice, from shared memory
  const float row_coef = coef[row];
  GradT* row_grad = grad + row * grad_stride + slice_start;
  for (int i = tid; i < vectors; i += kThreads) {
    const float4 z = slice4[i];
    const int column = slice_start + 4 * i;
    float4 g;
    g.x = column < width ? row_coef * __expf(z.x - lse) : 0.0f;
    g.y = column + 1 < width ? row_coef * __expf(z.y - lse) : 0.0f;
    g.z = column + 2 < width ? row_coef * __expf(z.z - lse) : 0.0f;
    g.w = column + 3 < width ? row_coef * __expf(z.w - lse) : 0.0f;
    store4<GradT>(row_grad + 4 * i, g);
  }
  for (int j = 4 * vectors + tid; j < slice_columns; j += kThreads) {
    const int column = slice_start + j;
    row_grad[j] = from_float<GradT>(column < width ? row_coef * __expf(slice[j] - lse) : 0.0f);
  }
  cluster.barrier_wait();  // no CTA leaves while another may still read its partial
}

template <typename GradT>
cudaError_t launch(const float* logits, const float* bias, int64_t rows, int64_t row_stride, int64_t width,
                   int64_t num_columns, float inv_temperature, const int64_t* ids, int64_t k, int64_t ids_stride,
                   const int64_t* labels, const float* coef, float* lse, float* lse_tempered, float* best,
                   int64_t* top1, float* at_ids, int64_t at_ids_stride, float* at_label, void* grad,
                   int64_t grad_stride, cudaStream_t stream) {
  const int64_t slice_len = ((num_columns + kRowPassCluster - 1) / kRowPassCluster + 3) / 4 * 4;
  const size_t shared_bytes = static_cast<size_t>(slice_len) * sizeof(float);
  auto kernel = softmax_row_pass_kernel<GradT>;
  cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
  if (status != cudaSuccess) return status;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(rows * kRowPassCluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = kRowPassCluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  const bool tempered = inv_temperature != 1.0f;
  return cudaLaunchKernelEx(&config, kernel, logits, bias, row_stride, static_cast<int>(width),
                            static_cast<int>(num_columns), static_cast<int>(slice_len), inv_temperature, tempered,
                            ids, static_cast<int>(k), ids_stride, labels, coef, lse, lse_tempered, best, top1, at_ids,
                            at_ids_stride, at_label, static_cast<GradT*>(grad), grad_stride);
}

}  // namespace

int64_t softmax_row_pass_max_columns() { return kMaxSliceFloats * kRowPassCluster; }

cudaError_t launch_softmax_row_pass(const float* logits, const float* bias, int64_t rows, int64_t row_stride,
                                    int64_t width, int64_t num_columns, float inv_temperature,
                                    const int64_t* ids, int64_t k, int64_t ids_stride, const int64_t* labels,
                                    const float* coef, float* lse, float* lse_tempered, float* best, int64_t* top1,
                                    float* at_ids, int64_t at_ids_stride, float* at_label, LogitsDtype grad_dtype,
                                    void* grad, int64_t grad_stride, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  switch (grad_dtype) {
    case LogitsDtype::kFloat32:
      return launch<float>(logits, bias, rows, row_stride, width, num_columns, inv_temperature, ids, k, ids_stride,
                           labels, coef, lse, lse_tempered, best, top1, at_ids, at_ids_stride, at_label, grad,
                           grad_stride, stream);
    case LogitsDtype::kFloat16:
      return launch<__half>(logits, bias, rows, row_stride, width, num_columns, inv_temperature, ids, k, ids_stride,
                            labels, coef, lse, lse_tempered, best, top1, at_ids, at_ids_stride, at_label, grad,
                            grad_stride, stream);
    case LogitsDtype::kBFloat16:
      return launch<__nv_bfloat16>(logits, bias, rows, row_stride, width, num_columns, inv_temperature, ids, k,
                                   ids_stride, labels, coef, lse, lse_tempered, best, top1, at_ids, at_ids_stride,
                                   at_label, grad, grad_stride, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kd_kernels
