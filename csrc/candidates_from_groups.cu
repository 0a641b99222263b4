// One block per row: its listed groups read a warp per group (several groups in flight per
// warp), the elements reaching the row's threshold appended to shared memory (one atomic per
// warp and group), then a bitonic sort and the first k written. It replaces, for large k, the
// Triton selection's own gather of candidates (kd_kernels/ops/topk_from_groups.py), which at
// k = 1024 took ~2 of its 3.4 ms over 8192 rows on an H200, and the separate sort of its keys.
#include <cmath>

#include "bitonic.cuh"
#include "candidates_from_groups.h"
#include "keys.cuh"

namespace kd_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kGroupsInFlight = 4;  // per warp: loads issued before the first is used
static_assert(kGroupColumns == 32, "one lane per column of a group");

// The sort stays in shared memory: through registers (sort_keys' sort) it took 78 registers
// instead of 30 (three blocks an SM instead of eight at k = 1024) and the default k = 1024 call
// 1.019x the time, timed in turn on an H200 (NOTES e33)
__global__ void __launch_bounds__(kThreads) candidates_from_groups_kernel(
    const float* logits, int64_t row_stride, const int32_t* group_ids, int64_t group_capacity, const int32_t* listed,
    const int32_t* thresholds, int width, float log2e_over_t, int k, int key_capacity, float* values,
    int32_t* columns, uint8_t* overflowed) {
  extern __shared__ uint64_t buffer[];
  __shared__ unsigned int count;
  const int64_t row = blockIdx.x;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  const int groups = static_cast<int>(min(static_cast<int64_t>(max(listed[row], 0)), group_capacity));
  // the threshold's signed order as the unsigned order of order_key
  const uint32_t threshold = static_cast<uint32_t>(thresholds[row]) ^ 0x80000000u;
  const float* row_logits = logits + row * row_stride;
  const int32_t* row_groups = group_ids + row * group_capacity;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int first = warp * kGroupsInFlight; first < groups; first += warps * kGroupsInFlight) {
    float z[kGroupsInFlight];
    int column[kGroupsInFlight];
#pragma unroll
    for (int g = 0; g < kGroupsInFlight; ++g) {
      column[g] = first + g < groups ? row_groups[first + g] * kGroupColumns + lane : width;
    }
#pragma unroll
    for (int g = 0; g < kGroupsInFlight; ++g) z[g] = column[g] < width ? row_logits[column[g]] : -INFINITY;
#pragma unroll
    for (int g = 0; g < kGroupsInFlight; ++g) {
      // the selection's own test (a product, then the compare: no fused multiply-add)
      const bool take = column[g] < width && order_key(__fmul_rn(z[g], log2e_over_t)) >= threshold;
      append_if(take, order_key(z[g]), column[g], buffer, &count, key_capacity);
    }
  }
  __syncthreads();
  const int found = static_cast<int>(count);
  if (threadIdx.x == 0) overflowed[row] = found > key_capacity;
  if (found > key_capacity) return;  // the row is redone by the caller
  int size = 1;
  while (size < found) size <<= 1;
  for (int i = found + threadIdx.x; i < size; i += blockDim.x) buffer[i] = 0ull;  // sorts after every key
  __syncthreads();
  sort_descending(buffer, size);
  write_top(buffer, found, k, values + row * k, columns + row * k);
}

}  // namespace

cudaError_t launch_candidates_from_groups(const float* logits, int64_t row_stride, const int32_t* group_ids,
                                          int64_t group_capacity, const int32_t* listed, const int32_t* thresholds,
                                          int64_t rows, int64_t width, float log2e_over_t, int64_t k,
                                          int64_t key_capacity, float* values, int32_t* columns,
                                          uint8_t* overflowed, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  int size = 1;
  while (size < key_capacity) size <<= 1;
  const size_t shared = static_cast<size_t>(size) * sizeof(uint64_t);  // <= 32 KiB: no opt-in needed
  candidates_from_groups_kernel<<<static_cast<unsigned int>(rows), kThreads, shared, stream>>>(
      logits, row_stride, group_ids, group_capacity, listed, thresholds, static_cast<int>(width), log2e_over_t,
      static_cast<int>(k), static_cast<int>(key_capacity), values, columns, overflowed);
  return cudaGetLastError();
}

}  // namespace kd_kernels
