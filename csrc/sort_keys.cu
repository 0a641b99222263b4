// One block per row: the row's keys (as unsigned keys of the same order) sorted by a bitonic
// sort of the next power of two above its count, in registers (KD_KERNELS_SORT_REGISTERS=1, the
// default) or in shared memory (0), the first k decoded. For the
// teacher's candidates from group maxima (kd_kernels/ops/topk_from_groups.py) at large k: 0.46 ms
// over 8192 rows of 1024 keys on an H200 (the profiler); with ~1.3k keys per row the whole
// selection took 3.4 ms with it against 4.0 ms with a torch sort of the keys.
#include "bitonic.cuh"
#include "keys.cuh"
#include "sort_keys.h"

namespace kd_kernels {
namespace {

constexpr int kSortThreads = 256;
constexpr uint64_t kSignBit = 0x8000000000000000ull;

// a row's keys in shared memory, every step of the sort through it
__global__ void __launch_bounds__(kSortThreads) sort_keys_kernel(const int64_t* keys, const int32_t* counts,
                                                                 int64_t capacity, int k, float* values,
                                                                 int32_t* columns) {
  extern __shared__ uint64_t buffer[];
  const int64_t row = blockIdx.x;
  const int count = static_cast<int>(min(static_cast<int64_t>(max(counts[row], 0)), capacity));
  int size = 1;
  while (size < count) size <<= 1;
  const int64_t* row_keys = keys + row * capacity;
  // flipping the sign bit makes the signed order unsigned (keys.cuh's candidates); padding (0)
  // sorts after every key
  for (int i = threadIdx.x; i < size; i += blockDim.x) {
    buffer[i] = i < count ? static_cast<uint64_t>(row_keys[i]) ^ kSignBit : 0ull;
  }
  __syncthreads();
  sort_descending(buffer, size);
  write_top(buffer, count, k, values + row * k, columns + row * k);
}

// ITEMS keys a thread in registers (kSortThreads * ITEMS >= the row's count), padded with 0
template <int ITEMS>
__device__ __forceinline__ void sort_row_in_registers(const int64_t* row_keys, int count, int k, float* values,
                                                      int32_t* columns, uint64_t* shared) {
  uint64_t held[ITEMS];
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    const int i = threadIdx.x * ITEMS + r;
    held[r] = i < count ? static_cast<uint64_t>(row_keys[i]) ^ kSignBit : 0ull;
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

__global__ void __launch_bounds__(kSortThreads) sort_keys_in_registers_kernel(const int64_t* keys,
                                                                              const int32_t* counts, int64_t capacity,
                                                                              int k, float* values,
                                                                              int32_t* columns) {
  extern __shared__ uint64_t buffer[];
  const int64_t row = blockIdx.x;
  const int count = static_cast<int>(min(static_cast<int64_t>(max(counts[row], 0)), capacity));
  const int64_t* row_keys = keys + row * capacity;
  float* row_values = values + row * k;
  int32_t* row_columns = columns + row * k;
  // the same size for the whole block: the row's count picks it (k <= count but for rows to redo)
  with_items_for<kSortThreads>(max(count, k), [&](auto items) {
    sort_row_in_registers<decltype(items)::value>(row_keys, count, k, row_values, row_columns, buffer);
  });
}

}  // namespace

cudaError_t launch_sort_keys(const int64_t* keys, const int32_t* counts, int64_t rows, int64_t capacity, int64_t k,
                             float* values, int32_t* columns, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  int size = kSortThreads;  // the register sort exchanges at least a key a thread through shared memory
  while (size < capacity) size <<= 1;
  const size_t shared = static_cast<size_t>(size) * sizeof(uint64_t);  // <= 32 KiB: no opt-in needed
  if (sort_in_registers(true)) {  // 25-31 % less time on an H200 (NOTES e32)
    sort_keys_in_registers_kernel<<<static_cast<unsigned int>(rows), kSortThreads, shared, stream>>>(
        keys, counts, capacity, static_cast<int>(k), values, columns);
  } else {
    sort_keys_kernel<<<static_cast<unsigned int>(rows), kSortThreads, shared, stream>>>(
        keys, counts, capacity, static_cast<int>(k), values, columns);
  }
  return cudaGetLastError();
}

}  // namespace kd_kernels
