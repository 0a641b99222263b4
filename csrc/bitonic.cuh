// Block-wide descending bitonic sorts: in shared memory (the top-k kernel) and with the keys in
// registers (the key sort), shared by the kernels of this folder.
#pragma once
#include <cstdint>
#include <type_traits>

namespace kd_kernels {

// Descending bitonic sort of buffer[0, size), size a power of two; every thread of the block
// calls it (it synchronizes the block after each step).
__device__ inline void sort_descending(uint64_t* buffer, int size) {
  for (int block = 2; block <= size; block <<= 1) {
    for (int stride = block >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < size / 2; t += blockDim.x) {
        const int i = 2 * t - (t & (stride - 1));
        const int j = i + stride;
        const bool descending = (i & block) == 0;
        const uint64_t a = buffer[i], b = buffer[j];
        if ((a < b) == descending) {
          buffer[i] = b;
          buffer[j] = a;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace kd_kernels

namespace kd_kernels {

// Descending bitonic sort of the kThreads * ITEMS keys a block holds in registers, thread t the
// keys t * ITEMS + r (r < ITEMS) before and after; shared holds kThreads * ITEMS keys. A step
// whose partner is in the same thread runs in registers, one in the same warp by shuffles, and
// only the steps across warps (6 of 66 at 2048 keys, 8 a thread) through shared memory, where
// the shared-memory sort above moves every key through shared memory at every step.
template <int kThreads, int ITEMS>
__device__ __forceinline__ void sort_descending_in_registers(uint64_t (&keys)[ITEMS], uint64_t* shared) {
  constexpr int kSize = kThreads * ITEMS;
  const int thread = threadIdx.x;
#pragma unroll
  for (int block = 2; block <= kSize; block <<= 1) {
#pragma unroll
    for (int stride = block >> 1; stride > 0; stride >>= 1) {
      if (stride < ITEMS) {
#pragma unroll
        for (int r = 0; r < ITEMS; ++r) {
          const int partner = r ^ stride;
          if (partner > r) {
            const bool descending = ((thread * ITEMS + r) & block) == 0;
            const uint64_t a = keys[r], b = keys[partner];
            if ((a < b) == descending) {
              keys[r] = b;
              keys[partner] = a;
            }
          }
        }
      } else {
        const bool across_warps = stride >= 32 * ITEMS;
        if (across_warps) {
          __syncthreads();  // the previous exchange's reads are done
#pragma unroll
          for (int r = 0; r < ITEMS; ++r) shared[r * kThreads + thread] = keys[r];  // conflict-free
          __syncthreads();
        }
#pragma unroll
        for (int r = 0; r < ITEMS; ++r) {
          const int index = thread * ITEMS + r;
          const uint64_t other = across_warps ? shared[r * kThreads + (thread ^ (stride / ITEMS))]
                                              : __shfl_xor_sync(0xffffffffu, keys[r], stride / ITEMS);
          // the lower index of a pair keeps the larger key where its block sorts descending
          const bool keep_larger = ((index & stride) == 0) == ((index & block) == 0);
          keys[r] = keep_larger ? (keys[r] > other ? keys[r] : other) : (keys[r] < other ? keys[r] : other);
        }
      }
    }
  }
}

}  // namespace kd_kernels

namespace kd_kernels {

// sort(std::integral_constant<int, ITEMS>) for the fewest ITEMS of 1, 2, 4, 8, 16 with
// kThreads * ITEMS >= size (16 past that): the register sorts' keys a thread, picked per block
template <int kThreads, typename Sort>
__device__ __forceinline__ void with_items_for(int size, Sort&& sort) {
  if (size <= kThreads) {
    sort(std::integral_constant<int, 1>{});
  } else if (size <= 2 * kThreads) {
    sort(std::integral_constant<int, 2>{});
  } else if (size <= 4 * kThreads) {
    sort(std::integral_constant<int, 4>{});
  } else if (size <= 8 * kThreads) {
    sort(std::integral_constant<int, 8>{});
  } else {
    sort(std::integral_constant<int, 16>{});
  }
}

}  // namespace kd_kernels
