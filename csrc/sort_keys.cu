// One block per row: the row's raw keys (the appending matmul's: a float's bits above its
// column) made unsigned keys of the sort's order as they are loaded, sorted by a bitonic sort in
// registers (steps within a thread in registers, within a warp by shuffles, across warps through
// shared memory), the first k decoded. A row holding more than k keys first keeps those reaching
// the largest floor that at least k of them reach (a bisection of the value bits) and sorts
// only those: ~k keys instead of the next power of two above the count.
#include <cooperative_groups.h>

#include "bitonic.cuh"
#include "keys.cuh"
#include "sort_keys.h"

namespace kd_kernels {
namespace {

constexpr int kSortThreads = 256;

// A stored raw key (the float's bits above the column) as an unsigned key of the sort's order
// (keys.cuh's candidates).
__device__ __forceinline__ uint64_t sortable_key(int64_t stored) {
  const uint64_t bits = static_cast<uint64_t>(stored);
  return candidate(order_key(__uint_as_float(static_cast<uint32_t>(bits >> 32))),
                   static_cast<int>(static_cast<uint32_t>(bits)));
}

// ITEMS keys a thread in registers (kSortThreads * ITEMS >= the row's count), padded with 0
template <int ITEMS>
__device__ __forceinline__ void sort_row_in_registers(const int64_t* row_keys, int count, int k, float* values,
                                                      int32_t* columns, uint64_t* shared) {
  uint64_t held[ITEMS];
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    const int i = threadIdx.x * ITEMS + r;
    held[r] = i < count ? sortable_key(row_keys[i]) : 0ull;
  }
  sort_descending_in_registers<kSortThreads, ITEMS>(held, shared);
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    const int i = threadIdx.x * ITEMS + r;
    if (i < k) {
      const bool present = i < count;
      values[i] = present ? key_value(static_cast<uint32_t>(held[r] >> 32)) : -INFINITY;
      columns[i] = present ? candidate_column(held[r]) : 0;
    }
  }
}

constexpr int kSortWarps = kSortThreads / 32;

// The block's count of flags (one a thread), the same in every thread: ``partial`` holds the
// warps' counts, two sets used in turn so that one barrier a call suffices.
__device__ __forceinline__ int block_count(int flags, int (&partial)[2][kSortWarps], int& parity) {
  const int warp_total = __reduce_add_sync(0xffffffffu, flags);
  if ((threadIdx.x & 31) == 0) partial[parity][threadIdx.x >> 5] = warp_total;
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int w = 0; w < kSortWarps; ++w) total += partial[parity][w];
  parity ^= 1;
  return total;
}

// Of a row's count > k keys (ITEMS a thread, kSortThreads * ITEMS >= count), those whose value
// bits reach the largest floor that at least k of them reach, copied (as loaded, in any order) to
// selected[]; returns how many: k, or more where keys of the k-th key's value tie past k. The
// floor by bisection of the unsigned value bits between the row's smallest and largest (~23
// block-wide counts for float32 logits), stopping early at a floor exactly k keys reach.
template <int ITEMS>
__device__ __forceinline__ int select_reaching_kth(const int64_t* row_keys, int count, int k, uint64_t* selected,
                                                  int (&partial)[2][kSortWarps], unsigned int* selected_count) {
  uint32_t value_bits[ITEMS];
  uint32_t smallest = 0xffffffffu, largest = 0u;
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    const int i = threadIdx.x * ITEMS + r;
    value_bits[r] = i < count ? static_cast<uint32_t>(sortable_key(row_keys[i]) >> 32) : 0u;
    if (i < count) {
      smallest = min(smallest, value_bits[r]);
      largest = max(largest, value_bits[r]);
    }
  }
  int parity = 0;
  // the row's extremes: two barriers once, through the partial counts' storage
  smallest = __reduce_min_sync(0xffffffffu, smallest);
  largest = __reduce_max_sync(0xffffffffu, largest);
  if ((threadIdx.x & 31) == 0) {
    partial[0][threadIdx.x >> 5] = static_cast<int>(smallest);
    partial[1][threadIdx.x >> 5] = static_cast<int>(largest);
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kSortWarps; ++w) {
    smallest = min(smallest, static_cast<uint32_t>(partial[0][w]));
    largest = max(largest, static_cast<uint32_t>(partial[1][w]));
  }
  __syncthreads();
  // count(bits >= low) >= k > count(bits >= high), block-uniform
  uint64_t low = smallest, high = static_cast<uint64_t>(largest) + 1;
  while (high - low > 1) {
    const uint64_t middle = low + (high - low) / 2;
    int reaching = 0;
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
      reaching += (threadIdx.x * ITEMS + r < count && value_bits[r] >= middle) ? 1 : 0;
    }
    const int total = block_count(reaching, partial, parity);
    if (total >= k) {
      low = middle;
      if (total == k) break;
    } else {
      high = middle;
    }
  }
  // at most `count` reach `low`: the buffer holds them all
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    const int i = threadIdx.x * ITEMS + r;
    const bool take = i < count && value_bits[r] >= low;
    append_entry_if(take, take ? static_cast<uint64_t>(row_keys[i]) : 0, selected, selected_count,
                    static_cast<unsigned int>(count));
  }
  __syncthreads();
  return static_cast<int>(*selected_count);
}

__global__ void __launch_bounds__(kSortThreads) sort_keys_kernel(const int64_t* keys, const int32_t* counts,
                                                                 int64_t capacity, int k, float* values,
                                                                 int32_t* columns) {
  extern __shared__ uint64_t buffer[];
  __shared__ int partial[2][kSortWarps];
  __shared__ unsigned int selected_count;
  const int64_t row = blockIdx.x;
  const int count = static_cast<int>(min(static_cast<int64_t>(max(counts[row], 0)), capacity));
  const int64_t* row_keys = keys + row * capacity;
  int sorted_count = count;
  if (count > k) {
    if (threadIdx.x == 0) selected_count = 0;  // published by the selection's barriers
    with_items_for<kSortThreads>(count, [&](auto items) {
      sorted_count = select_reaching_kth<decltype(items)::value>(row_keys, count, k, buffer, partial,
                                                                 &selected_count);
    });
    row_keys = reinterpret_cast<const int64_t*>(buffer);  // the sort loads them before its first exchange
  }
  float* row_values = values + row * k;
  int32_t* row_columns = columns + row * k;
  // the same size for the whole block: the count picks it (k <= count but for rows to redo)
  with_items_for<kSortThreads>(max(sorted_count, k), [&](auto items) {
    sort_row_in_registers<decltype(items)::value>(row_keys, sorted_count, k, row_values, row_columns, buffer);
  });
}

}  // namespace

cudaError_t launch_sort_keys(const int64_t* keys, const int32_t* counts, int64_t rows, int64_t capacity, int64_t k,
                             float* values, int32_t* columns, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  int size = kSortThreads;  // the register sort exchanges at least a key a thread through shared memory
  while (size < capacity) size <<= 1;
  const size_t shared = static_cast<size_t>(size) * sizeof(uint64_t);  // <= 32 KiB: no opt-in needed
  sort_keys_kernel<<<static_cast<unsigned int>(rows), kSortThreads, shared, stream>>>(keys, counts, capacity,
                                                                                       static_cast<int>(k), values,
                                                                                       columns);
  return cudaGetLastError();
}

}  // namespace kd_kernels
