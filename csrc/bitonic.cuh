// Block-wide bitonic sort in shared memory, shared by the kernels of this folder.
#pragma once
#include <cstdint>

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
