// One block per row: the programs that saw the row's tile listed first, then a warp per listed
// program reads its log of the row's place in a tile (consecutive entries, a lane each), the
// entries tagged with the row's
// tile appended to shared memory as sort keys (one atomic per warp and load), then a bitonic
// sort through registers and the first k written. The appending matmul keeps no per-row count
// in memory: waiting for an atomic's result a tile cost it ~5 % (NOTES e33), so the row's
// entries are gathered here instead.
#include <cmath>

#include "bitonic.cuh"
#include "keys.cuh"
#include "rank_appends.h"

namespace kd_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 4;  // per lane: loads issued before the first is used
constexpr uint32_t kColumnMask = (1u << kLogColumnBits) - 1u;

__global__ void __launch_bounds__(kThreads) rank_appends_kernel(const uint2* logs, const int32_t* log_counts,
                                                                const uint8_t* row_tiles_seen, int programs,
                                                                int block_m, int row_tiles, int log_capacity, int k,
                                                                float* values, int32_t* columns,
                                                                uint8_t* overflowed) {
  extern __shared__ uint64_t buffer[];
  __shared__ unsigned int count, listed;
  __shared__ int lost;
  __shared__ int listed_programs[kMaxRankPrograms], listed_entries[kMaxRankPrograms];
  const int row = blockIdx.x;
  const uint32_t row_tile = static_cast<uint32_t>(row / block_m);
  const int place = row % block_m;
  if (threadIdx.x == 0) count = 0, listed = 0, lost = 0;
  __syncthreads();
  // the programs that saw the row's tile, their flags and counts loaded at once (a warp walking
  // them in turn waited on one load after another)
  for (int program = threadIdx.x; program < programs; program += blockDim.x) {
    const bool saw = row_tiles_seen[static_cast<int64_t>(program) * row_tiles + row_tile];
    const int logged = log_counts[static_cast<int64_t>(program) * block_m + place];
    if (saw) {
      const unsigned int slot = atomicAdd(&listed, 1u);
      listed_programs[slot] = program;
      listed_entries[slot] = min(logged, log_capacity);
      if (logged > log_capacity) lost = 1;
    }
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int listing = warp; listing < static_cast<int>(listed); listing += warps) {
    const int entries = listed_entries[listing];
    const uint2* entry = logs + (static_cast<int64_t>(listed_programs[listing]) * block_m + place) * log_capacity;
    for (int first = 0; first < entries; first += 32 * kLoadsInFlight) {
      uint2 loaded[kLoadsInFlight];
#pragma unroll
      for (int j = 0; j < kLoadsInFlight; ++j) {
        const int i = first + j * 32 + lane;
        loaded[j] = i < entries ? entry[i] : make_uint2(0u, 0u);
      }
#pragma unroll
      for (int j = 0; j < kLoadsInFlight; ++j) {
        const bool take = first + j * 32 + lane < entries && (loaded[j].x >> kLogColumnBits) == row_tile;
        append_if(take, order_key(__uint_as_float(loaded[j].y)), static_cast<int>(loaded[j].x & kColumnMask),
                  buffer, &count, kMaxRankedEntries);
      }
    }
  }
  __syncthreads();
  const int found = static_cast<int>(count);
  if (threadIdx.x == 0) overflowed[row] = lost || found < k || found > kMaxRankedEntries;
  const int kept = min(found, kMaxRankedEntries);
  int size = kThreads;  // the register sort exchanges at least a key a thread in the buffer
  while (size < kept) size <<= 1;
  for (int i = kept + threadIdx.x; i < size; i += blockDim.x) buffer[i] = 0ull;  // sorts after every key
  __syncthreads();
  sort_descending_via_registers<kThreads>(buffer, size);
  write_top(buffer, kept, k, values + static_cast<int64_t>(row) * k, columns + static_cast<int64_t>(row) * k);
}

}  // namespace

cudaError_t launch_rank_appends(const int64_t* logs, const int32_t* log_counts, const uint8_t* row_tiles_seen,
                                int64_t programs, int64_t block_m, int64_t log_capacity, int64_t rows, int64_t k,
                                float* values, int32_t* columns, uint8_t* overflowed, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t row_tiles = (rows + block_m - 1) / block_m;
  const size_t shared = static_cast<size_t>(kMaxRankedEntries) * sizeof(uint64_t);  // 32 KiB: no opt-in needed
  rank_appends_kernel<<<static_cast<unsigned int>(rows), kThreads, shared, stream>>>(
      reinterpret_cast<const uint2*>(logs), log_counts, row_tiles_seen, static_cast<int>(programs),
      static_cast<int>(block_m), static_cast<int>(row_tiles), static_cast<int>(log_capacity), static_cast<int>(k),
      values, columns, overflowed);
  return cudaGetLastError();
}

}  // namespace kd_kernels
