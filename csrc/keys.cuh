// (value, column) candidates as one 64-bit key, and their warp-aggregated append to a shared
// buffer: shared by the kernels of this folder. The key orders like kd_kernels/ops/sort_keys.py's
// signed keys with the sign bit flipped (an unsigned order).
#pragma once
#include <cooperative_groups.h>
#include <cmath>
#include <cstdint>

namespace kd_kernels {

// Unsigned keys that order like the floats (for non-NaN values; -0.0 and 0.0 get one key: they
// are equal values, whose ties go to the lower column).
__device__ __forceinline__ uint32_t order_key(float value) {
  const uint32_t bits = value == 0.f ? 0u : __float_as_uint(value);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Candidate = (key << 32) | ~column: sorting descending puts larger values first and, among
// equal values, lower columns first.
__device__ __forceinline__ uint64_t candidate(uint32_t key, int column) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(column));
}

__device__ __forceinline__ int candidate_column(uint64_t entry) {
  return static_cast<int>(~static_cast<uint32_t>(entry & 0xFFFFFFFFull));
}

// Appends `entry` to buffer[count++] when `take`, one shared atomic per warp: entries past
// `capacity` are counted, not stored.
__device__ __forceinline__ void append_entry_if(bool take, uint64_t entry, uint64_t* buffer, unsigned int* count,
                                                unsigned int capacity) {
  if (!take) return;
  cooperative_groups::coalesced_group taking = cooperative_groups::coalesced_threads();
  unsigned int base = 0;
  if (taking.thread_rank() == 0) base = atomicAdd(count, taking.size());
  const unsigned int slot = taking.shfl(base, 0) + taking.thread_rank();
  if (slot < capacity) buffer[slot] = entry;
}

// Appends (key, column) to buffer[count++] when `take` (append_entry_if).
__device__ __forceinline__ void append_if(bool take, uint32_t key, int column, uint64_t* buffer,
                                          unsigned int* count, int capacity) {
  append_entry_if(take, candidate(key, column), buffer, count, static_cast<unsigned int>(capacity));
}

// The first k of the sorted buffer[0, count) decoded into values (float32) and columns (int32);
// -inf at column 0 past count. Every thread of the block calls it.
__device__ __forceinline__ void write_top(const uint64_t* buffer, int count, int k, float* values, int32_t* columns) {
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    const bool present = i < count;
    values[i] = present ? key_value(static_cast<uint32_t>(buffer[i] >> 32)) : -INFINITY;
    columns[i] = present ? candidate_column(buffer[i]) : 0;
  }
}

}  // namespace kd_kernels
