// One block per row: the row's keys (as unsigned keys of the same order) sorted by a bitonic
// sort of the next power of two above its count, in registers (KD_KERNELS_SORT_REGISTERS=1, the
// default) or in shared memory (0), the first k decoded. The register sort of a row holding more
// than k keys first selects the keys at or above the k-th key's value (a bisection of the value
// bits, KD_KERNELS_SORT_SELECT=1, the default) and sorts only those: ~k instead of the next power
// of two above the count (2048 slots for ~1.7k keys at k = 1024). For the
// teacher's candidates from group maxima (kd_kernels/ops/topk_from_groups.py) at large k: 0.46 ms
// over 8192 rows of 1024 keys on an H200 (the profiler); with ~1.3k keys per row the whole
// selection took 3.4 ms with it against 4.0 ms with a torch sort of the keys.
#include <cooperative_groups.h>

#include "bitonic.cuh"
#include "keys.cuh"
#include "sort_keys.h"
#include "switches.h"

namespace kd_kernels {
namespace {

constexpr int kSortThreads = 256;
constexpr uint64_t kSignBit = 0x8000000000000000ull;

// A stored key as an unsigned key of the sort's order (keys.cuh's candidates): `raw`, the
// appending matmul's (the float's bits above the column), else kd_kernels/ops/sort_keys.py's
// signed keys, whose order flipping the sign bit makes unsigned.
template <bool RAW>
__device__ __forceinline__ uint64_t sortable_key(int64_t stored) {
  const uint64_t bits = static_cast<uint64_t>(stored);
  if (!RAW) return bits ^ kSignBit;
  return candidate(order_key(__uint_as_float(static_cast<uint32_t>(bits >> 32))),
                   static_cast<int>(static_cast<uint32_t>(bits)));
}

// a row's keys in shared memory, every step of the sort through it
template <bool RAW>
__global__ void __launch_bounds__(kSortThreads) sort_keys_kernel(const int64_t* keys, const int32_t* counts,
                                                                 int64_t capacity, int k, float* values,
                                                                 int32_t* columns) {
  extern __shared__ uint64_t buffer[];
  const int64_t row = blockIdx.x;
  const int count = static_cast<int>(min(static_cast<int64_t>(max(counts[row], 0)), capacity));
  int size = 1;
  while (size < count) size <<= 1;
  const int64_t* row_keys = keys + row * capacity;
  // padding (0) sorts after every key
  for (int i = threadIdx.x; i < size; i += blockDim.x) {
    buffer[i] = i < count ? sortable_key<RAW>(row_keys[i]) : 0ull;
  }
  __syncthreads();
  sort_descending(buffer, size);
  write_top(buffer, count, k, values + row * k, columns + row * k);
}

// ITEMS keys a thread in registers (kSortThreads * ITEMS >= the row's count), padded with 0
template <int ITEMS, bool RAW>
__device__ __forceinline__ void sort_row_in_registers(const int64_t* row_keys, int count, int k, float* values,
                                                      int32_t* columns, uint64_t* shared) {
  uint64_t held[ITEMS];
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    const int i = threadIdx.x * ITEMS + r;
    held[r] = i < count ? sortable_key<RAW>(row_keys[i]) : 0ull;
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
template <int ITEMS, bool RAW>
__device__ __forceinline__ int select_reaching_kth(const int64_t* row_keys, int count, int k, uint64_t* selected,
                                                  int (&partial)[2][kSortWarps], unsigned int* selected_count) {
  uint32_t value_bits[ITEMS];
  uint32_t smallest = 0xffffffffu, largest = 0u;
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    const int i = threadIdx.x * ITEMS + r;
    value_bits[r] = i < count ? static_cast<uint32_t>(sortable_key<RAW>(row_keys[i]) >> 32) : 0u;
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

template <bool RAW>
__global__ void __launch_bounds__(kSortThreads) sort_keys_in_registers_kernel(const int64_t* keys,
                                                                              const int32_t* counts, int64_t capacity,
                                                                              int k, bool select, float* values,
                                                                              int32_t* columns) {
  extern __shared__ uint64_t buffer[];
  __shared__ int partial[2][kSortWarps];
  __shared__ unsigned int selected_count;
  const int64_t row = blockIdx.x;
  const int count = static_cast<int>(min(static_cast<int64_t>(max(counts[row], 0)), capacity));
  const int64_t* row_keys = keys + row * capacity;
  int sorted_count = count;
  if (select && count > k) {
    if (threadIdx.x == 0) selected_count = 0;  // published by the selection's barriers
    with_items_for<kSortThreads>(count, [&](auto items) {
      sorted_count = select_reaching_kth<decltype(items)::value, RAW>(row_keys, count, k, buffer, partial,
                                                                      &selected_count);
    });
    row_keys = reinterpret_cast<const int64_t*>(buffer);  // the sort loads them before its first exchange
  }
  float* row_values = values + row * k;
  int32_t* row_columns = columns + row * k;
  // the same size for the whole block: the count picks it (k <= count but for rows to redo)
  with_items_for<kSortThreads>(max(sorted_count, k), [&](auto items) {
    sort_row_in_registers<decltype(items)::value, RAW>(row_keys, sorted_count, k, row_values, row_columns, buffer);
  });
}

}  // namespace

template <bool RAW>
void launch_sorts(const int64_t* keys, const int32_t* counts, int64_t rows, int64_t capacity, int64_t k,
                  float* values, int32_t* columns, cudaStream_t stream) {
  int size = kSortThreads;  // the register sort exchanges at least a key a thread through shared memory
  while (size < capacity) size <<= 1;
  const size_t shared = static_cast<size_t>(size) * sizeof(uint64_t);  // <= 32 KiB: no opt-in needed
  // KD_KERNELS_SORT_REGISTERS: through registers, 25-31 % less time on an H200 (NOTES e32), or
  // every step through shared memory; KD_KERNELS_SORT_SELECT: the register sort selects the keys
  // reaching the k-th value first (0.51 against 0.84 ms at k = 1024, NOTES e34) or sorts them all
  if (switch_on("KD_KERNELS_SORT_REGISTERS", true)) {
    sort_keys_in_registers_kernel<RAW><<<static_cast<unsigned int>(rows), kSortThreads, shared, stream>>>(
        keys, counts, capacity, static_cast<int>(k), switch_on("KD_KERNELS_SORT_SELECT", true), values, columns);
  } else {
    sort_keys_kernel<RAW><<<static_cast<unsigned int>(rows), kSortThreads, shared, stream>>>(
        keys, counts, capacity, static_cast<int>(k), values, columns);
  }
}

cudaError_t launch_sort_keys(const int64_t* keys, const int32_t* counts, int64_t rows, int64_t capacity, int64_t k,
                             bool raw, float* values, int32_t* columns, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (raw) {
    launch_sorts<true>(keys, counts, rows, capacity, k, values, columns, stream);
  } else {
    launch_sorts<false>(keys, counts, rows, capacity, k, values, columns, stream);
  }
  return cudaGetLastError();
}

}  // namespace kd_kernels
