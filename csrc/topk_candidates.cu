// Persistent thread blocks, two or four per SM (one's sorts overlap the others' reads), rows
// taken in turn; each row read once in the common case:
//   pass 1  per 16-byte pack: the running max / sum-exp at the temperature (one rescale per
//           pack, one exp per element), and per thread 8 interleaved bucket maxima; each warp
//           then takes the ceil(k / warps)-th largest of its maxima, and the smallest of those
//           is a threshold T with at least k row elements >= T (the maxima are distinct
//           elements), found without a block-wide sort. The same pass already appends the
//           elements above a floor (the block's previous threshold minus a margin) to a
//           shared-memory buffer (warp-aggregated atomics). For 16-bit logits the packs come
//           through a 4-stage cp.async pipeline in shared memory (more bytes in flight than
//           registers allow);
//   pass 2  only when this row's T is below that floor (or the buffer overflowed): append
//           every element >= T instead.
// The buffer (~1-3 k elements on LLM logits) is sorted by (value desc, column asc) and the
// first k written; when pass 1 collected it, the elements below T are dropped first (a
// smaller sort). Rows where more elements reach T than the buffer holds (8192 in wide blocks,
// 4096 in narrow ones: massive ties, adversarial orders) take an exact slow path: bisection
// on the value to the k-th largest, then an in-order collection that keeps the lowest columns
// among ties.
#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <algorithm>
#include <cfloat>

#include "bitonic.cuh"
#include "keys.cuh"
#include "topk_candidates.h"

namespace cg = cooperative_groups;

namespace kd_kernels {
namespace {

// Two shapes of the persistent blocks: wide (512 threads, two per SM, 8192 candidates: any k)
// and narrow (256 threads, four per SM, 4096 candidates: k <= 512), where three blocks of an
// SM stream while one sorts.
struct Wide {
  static constexpr int kThreads = 512, kBlocksPerSM = 2, kCapacity = 8192;
};
struct Narrow {
  static constexpr int kThreads = 256, kBlocksPerSM = 4, kCapacity = 4096;
};
// Narrow blocks where the serial work of a row (its sort) weighs most against its reads: 16-bit
// rows (bound by instructions, twice the elements per byte) and float32 rows of at most
// kNarrowMaxFloat32Width columns (the lean schedule's tiles, tensor-parallel shards); wide
// blocks for longer float32 rows, which are bound by HBM. The two shapes sum the logsumexp in
// other orders (float32 rounding apart); ids are the same.
template <typename T>
constexpr bool kNarrowFor16Bit = sizeof(T) == 2;
constexpr int64_t kNarrowMaxFloat32Width = 65536;
constexpr int kSamplesPerThread = 8;
// Pass 1 over 16-bit rows streams 16-byte packs through a cp.async pipeline in shared memory
// (more bytes in flight than registers allow); float32 rows go through registers.
template <typename T>
constexpr bool kPipelined = sizeof(T) == 2;
// the pass-1 floor: the previous row's T minus this many times the mean row-to-row move of T;
// float32 rows gain from a wider one (fewer second reads), 16-bit ones do not (their pass 1 is
// bound by instructions, which the extra candidates add to)
template <typename T>
constexpr float kMarginFactor = sizeof(T) == 4 ? 3.f : 2.f;
constexpr float kLog2e = 1.4426950408889634f;  // log2(e): pass 1 sums 2^((z - max) · log2e / τ)
static_assert(Wide::kCapacity >= 8 * kMaxTopK, "the candidate buffer must hold several times k");
constexpr int kNarrowMaxTopK = Narrow::kCapacity / 8;
// 16-byte loads in flight per thread: 16 elements per thread per step whatever the dtype
// (4 for 16-bit types would need more registers than the 64 that two blocks per SM leave)
template <typename T>
constexpr int kUnroll = sizeof(T) == 4 ? 4 : 2;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// The row split at 16-byte boundaries: `head` unaligned columns, then `packs` aligned packs
// from `body`, then the tail columns from head + packs * kSize.
template <typename T>
struct RowLayout {
  int head, packs;
  const Pack<T>* body;

  __device__ __forceinline__ RowLayout(const T* row, int width) {
    head = min(static_cast<int>(((16 - (reinterpret_cast<uintptr_t>(row) & 15)) & 15) / sizeof(T)), width);
    packs = (width - head) / Pack<T>::kSize;
    body = reinterpret_cast<const Pack<T>*>(row + head);
  }

  // visit.one for the columns outside the packs (the head and the tail)
  template <typename Visit>
  __device__ __forceinline__ void visit_ends(const T* row, int width, Visit& visit, bool tail) const {
    const int first = tail ? head + packs * Pack<T>::kSize : 0;
    const int last = tail ? width : head;
    for (int i = first + threadIdx.x; i < last; i += blockDim.x) visit.one(to_float(row[i]), i);
  }
};

// Visits every column < width of the row once, spread over the block: visit.pack(values,
// first_column, slot) for 16-byte-aligned packs (slot: a compile-time position after
// unrolling), visit.one(value, column) for the unaligned head and the tail.
template <typename T, typename Visit>
__device__ __forceinline__ void visit_row(const T* row, int width, Visit& visit) {
  constexpr int kVec = Pack<T>::kSize;
  const RowLayout<T> layout(row, width);
  layout.visit_ends(row, width, visit, false);
  const int head = layout.head, packs = layout.packs;
  const Pack<T>* body = layout.body;
  constexpr int kSteps = kUnroll<T>;
  for (int first = threadIdx.x; first < packs; first += kSteps * blockDim.x) {
    Pack<T> loaded[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int p = first + u * blockDim.x;
      if (p < packs) loaded[u] = body[p];
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int p = first + u * blockDim.x;
      if (p < packs) {
        float values[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) values[j] = to_float(loaded[u].v[j]);
        visit.template pack<kVec>(values, head + p * kVec, u * kVec);
      }
    }
  }
  layout.visit_ends(row, width, visit, true);
}

// Stages of the asynchronous pass-1 pipeline for 16-bit logits: each thread keeps
// kStages - 1 16-byte copies (global -> shared, cp.async) in flight while it works on one,
// without holding registers for them. 16-bit rows carry twice the elements per byte of
// float32 ones, so the register-bound unroll left too few bytes in flight to fill HBM.
constexpr int kStages = 4;

// visit_row for pass 1 of 16-bit rows: the same visits, the aligned packs through `stages`
// ([kStages][blockDim] packs of shared memory). Each thread reads back only the slots it
// copied itself, so the pipeline needs no block barrier.
template <typename T, typename Visit>
__device__ __forceinline__ void visit_row_pipelined(const T* row, int width, Visit& visit, Pack<T>* stages) {
  constexpr int kVec = Pack<T>::kSize;
  const RowLayout<T> layout(row, width);
  layout.visit_ends(row, width, visit, false);
  const int head = layout.head, packs = layout.packs;
  const Pack<T>* body = layout.body;
  const int steps = (packs + blockDim.x - 1) / blockDim.x;
  auto issue = [&](int step) {
    const int p = step * blockDim.x + threadIdx.x;
    if (step < steps && p < packs) __pipeline_memcpy_async(&stages[(step % kStages) * blockDim.x + threadIdx.x], &body[p], 16);
    __pipeline_commit();  // one group per step, empty or not: wait_prior counts groups
  };
  for (int step = 0; step < kStages - 1; ++step) issue(step);
  for (int step = 0; step < steps; ++step) {
    issue(step + kStages - 1);
    __pipeline_wait_prior(kStages - 1);  // this step's copy has landed
    const int p = step * blockDim.x + threadIdx.x;
    if (p < packs) {
      const Pack<T> loaded = stages[(step % kStages) * blockDim.x + threadIdx.x];
      float values[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) values[j] = to_float(loaded.v[j]);
      visit.template pack<kVec>(values, head + p * kVec, 0);
    }
  }
  __pipeline_wait_prior(0);
  layout.visit_ends(row, width, visit, true);
}

__device__ __forceinline__ int next_power_of_two(int n) {
  int p = 2;
  while (p < n) p <<= 1;
  return p;
}

// Pass 1 state of one thread: max and sum of exp2 in the log2 domain, and the maxima of its
// kSamplesPerThread interleaved buckets of elements.
struct RowScan {
  float log2e_over_t;
  float floor;  // elements >= floor are appended to the buffer already in this pass
  uint64_t* buffer;
  unsigned int* count;
  int capacity;
  float max2 = -FLT_MAX;  // finite, so that -inf logits add exp2(-inf) = 0, never NaN
  float sum2 = 0.f;
  float bucket_max[kSamplesPerThread];

  __device__ RowScan(float scale, float floor_, uint64_t* buffer_, unsigned int* count_, int capacity_)
      : log2e_over_t(scale), floor(floor_), buffer(buffer_), count(count_), capacity(capacity_) {
#pragma unroll
    for (int j = 0; j < kSamplesPerThread; ++j) bucket_max[j] = -INFINITY;
  }

  __device__ __forceinline__ void rescale_to(float candidate_max2) {
    if (candidate_max2 > max2) {
      sum2 *= exp2f(max2 - candidate_max2);
      max2 = candidate_max2;
    }
  }

  template <int N>
  __device__ __forceinline__ void pack(const float (&x)[N], int first_column, int slot) {
    float pack_max = x[0];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      pack_max = fmaxf(pack_max, x[j]);
      bucket_max[(slot + j) % kSamplesPerThread] = fmaxf(bucket_max[(slot + j) % kSamplesPerThread], x[j]);
    }
    rescale_to(pack_max * log2e_over_t);
#pragma unroll
    for (int j = 0; j < N; ++j) sum2 += exp2f(fmaf(x[j], log2e_over_t, -max2));
    if (pack_max >= floor) {
#pragma unroll
      for (int j = 0; j < N; ++j) append_if(x[j] >= floor, order_key(x[j]), first_column + j, buffer, count, capacity);
    }
  }

  __device__ __forceinline__ void one(float x, int column) {
    bucket_max[0] = fmaxf(bucket_max[0], x);
    rescale_to(x * log2e_over_t);
    sum2 += exp2f(fmaf(x, log2e_over_t, -max2));
    append_if(x >= floor, order_key(x), column, buffer, count, capacity);
  }
};

struct MaxSum {
  float max2, sum2;
};

struct CombineMaxSum {
  __device__ __forceinline__ MaxSum operator()(const MaxSum& a, const MaxSum& b) const {
    const float m = fmaxf(a.max2, b.max2);
    return {m, a.sum2 * exp2f(a.max2 - m) + b.sum2 * exp2f(b.max2 - m)};
  }
};

struct CollectAtLeast {
  float threshold;
  uint64_t* buffer;
  unsigned int* count;
  int capacity;
  __device__ __forceinline__ void one(float x, int column) {
    append_if(x >= threshold, order_key(x), column, buffer, count, capacity);
  }
  template <int N>
  __device__ __forceinline__ void pack(const float (&x)[N], int first_column, int) {
#pragma unroll
    for (int j = 0; j < N; ++j) one(x[j], first_column + j);
  }
};

struct CountAtLeast {
  uint32_t threshold;
  unsigned int n = 0;
  __device__ __forceinline__ void one(float x, int) { n += order_key(x) >= threshold; }
  template <int N>
  __device__ __forceinline__ void pack(const float (&x)[N], int, int) {
#pragma unroll
    for (int j = 0; j < N; ++j) one(x[j], 0);
  }
};

// The `rank`-th largest (1-based) of the warp's 32 · kSamplesPerThread values, by repeated
// removal of the warp maximum (rank <= 64 here).
__device__ __forceinline__ float warp_rank_value(float (&values)[kSamplesPerThread], int rank) {
  const int lane = threadIdx.x & 31;
  float result = -INFINITY;
  for (int r = 0; r < rank; ++r) {
    float local = values[0];
#pragma unroll
    for (int j = 1; j < kSamplesPerThread; ++j) local = fmaxf(local, values[j]);
    float warp_max = local;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) warp_max = fmaxf(warp_max, __shfl_xor_sync(0xffffffffu, warp_max, offset));
    result = warp_max;
    const unsigned holders = __ballot_sync(0xffffffffu, local == warp_max);
    if (lane == __ffs(holders) - 1) {
      bool removed = false;
#pragma unroll
      for (int j = 0; j < kSamplesPerThread; ++j) {
        if (!removed && values[j] == warp_max) {
          values[j] = -INFINITY;
          removed = true;
        }
      }
    }
  }
  return result;
}

template <int Threads>
struct BlockPrimitives {
  using ReduceMaxSum = cub::BlockReduce<MaxSum, Threads>;
  using ReduceCount = cub::BlockReduce<unsigned int, Threads>;
  using ScanCount = cub::BlockScan<int, Threads>;
};

template <typename T, int Threads>
__device__ unsigned int count_at_least(const T* row, int width, uint32_t threshold,
                                       typename BlockPrimitives<Threads>::ReduceCount::TempStorage& storage,
                                       unsigned int* shared) {
  CountAtLeast counter{threshold};
  visit_row(row, width, counter);
  const unsigned int total = typename BlockPrimitives<Threads>::ReduceCount(storage).Sum(counter.n);
  if (threadIdx.x == 0) *shared = total;
  __syncthreads();
  const unsigned int result = *shared;
  __syncthreads();
  return result;
}

// The exact k largest (lower columns first among ties) into buffer[0, k), when more than
// `capacity` elements reach the sampled threshold. Returns k.
template <typename T, int Threads>
__device__ int collect_exact(const T* row, int width, int k, uint32_t low, uint32_t high, uint64_t* buffer,
                             unsigned int* count, int capacity,
                             typename BlockPrimitives<Threads>::ReduceCount::TempStorage& reduce_storage,
                             typename BlockPrimitives<Threads>::ScanCount::TempStorage& scan_storage) {
  // count(key >= low) >= k holds; find the largest such key: the k-th largest value
  while (low < high) {
    const uint32_t mid = low + (high - low + 1) / 2;
    if (count_at_least<T, Threads>(row, width, mid, reduce_storage, count) >= static_cast<unsigned int>(k)) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  const uint32_t kth = low;
  const int above = (kth == 0xffffffffu) ? 0 : static_cast<int>(count_at_least<T, Threads>(row, width, kth + 1,
                                                                                             reduce_storage, count));
  const int ties_wanted = k - above;
  if (threadIdx.x == 0) *count = 0;
  __syncthreads();
  int ties_seen = 0;  // the same in every thread
  for (int start = 0; start < width; start += blockDim.x) {
    const int column = start + threadIdx.x;
    const uint32_t key = column < width ? order_key(to_float(row[column])) : 0u;
    const bool tie = column < width && key == kth;
    int tie_rank = 0, ties_here = 0;
    typename BlockPrimitives<Threads>::ScanCount(scan_storage).ExclusiveSum(tie ? 1 : 0, tie_rank, ties_here);
    const bool take = (column < width && key > kth) || (tie && ties_seen + tie_rank < ties_wanted);
    append_if(take, key, column, buffer, count, capacity);
    ties_seen += ties_here;
    __syncthreads();
  }
  return k;
}

template <typename T, typename Shape>
__global__ void __launch_bounds__(Shape::kThreads, Shape::kBlocksPerSM)
topk_candidates_kernel(const T* __restrict__ logits, int64_t rows, int64_t row_stride, int width, int k,
                       float temperature, float* __restrict__ values, int32_t* __restrict__ indices, float* __restrict__ lse) {
  constexpr int kCapacity = Shape::kCapacity, kWarps = Shape::kThreads / 32;
  using Primitives = BlockPrimitives<Shape::kThreads>;
  extern __shared__ uint64_t buffer[];  // kCapacity entries, then (16-bit logits) the pipeline's stages
  __shared__ unsigned int count;
  __shared__ unsigned int threshold_key;
  __shared__ unsigned int max_key;
  __shared__ union {
    typename Primitives::ReduceMaxSum::TempStorage max_sum;
    typename Primitives::ReduceCount::TempStorage count;
    typename Primitives::ScanCount::TempStorage scan;
  } storage;

  // Rows of one block share a scale: elements >= (the previous row's threshold - margin) are
  // collected during pass 1, and pass 2 is skipped when this row's threshold lies above that
  // floor (then every element >= it is in the buffer). The margin is twice the running mean
  // of how much the threshold moves from row to row, widened after a miss. The result never
  // depends on any of it.
  float previous_threshold = INFINITY, mean_move = 0.f, margin = 0.f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = logits + r * row_stride;
    if (threadIdx.x == 0) {
      count = 0;
      threshold_key = 0xffffffffu;
      max_key = 0;
    }
    __syncthreads();
    float floor = previous_threshold - margin;
    if (!isfinite(floor)) floor = INFINITY;  // nothing to go by: collect in pass 2

    RowScan scan(kLog2e / temperature, floor, buffer, &count, kCapacity);
    if (kPipelined<T>) {
      visit_row_pipelined(row, width, scan, reinterpret_cast<Pack<T>*>(buffer + kCapacity));
    } else {
      visit_row(row, width, scan);
    }
    const MaxSum total =
        typename Primitives::ReduceMaxSum(storage.max_sum).Reduce(MaxSum{scan.max2, scan.sum2}, CombineMaxSum());
    if (threadIdx.x == 0) lse[r] = (total.max2 + log2f(total.sum2)) * 0.6931471805599453f;
    float thread_max = scan.bucket_max[0];
#pragma unroll
    for (int j = 1; j < kSamplesPerThread; ++j) thread_max = fmaxf(thread_max, scan.bucket_max[j]);
    atomicMax(&max_key, order_key(thread_max));
    const float warp_threshold = warp_rank_value(scan.bucket_max, (k + kWarps - 1) / kWarps);
    if ((threadIdx.x & 31) == 0) atomicMin(&threshold_key, order_key(warp_threshold));
    __syncthreads();
    const uint32_t threshold = threshold_key;
    const float threshold_value = key_value(threshold);
    int found = static_cast<int>(count);
    const bool collected = found <= kCapacity && threshold_value >= floor;
    const float move = fabsf(threshold_value - previous_threshold);
    if (isfinite(move)) mean_move = 0.8f * mean_move + 0.2f * move;
    margin = collected ? kMarginFactor<T> * mean_move + 1e-3f * fabsf(threshold_value)
                       : margin + kMarginFactor<T> * fmaxf(floor - threshold_value, 0.f);
    if (!isfinite(margin)) margin = 0.f;
    previous_threshold = threshold_value;
    __syncthreads();

    if (!collected) {
      if (threadIdx.x == 0) count = 0;
      __syncthreads();
      CollectAtLeast collect{threshold_value, buffer, &count, kCapacity};
      visit_row(row, width, collect);
      __syncthreads();
      found = static_cast<int>(count);
      if (found > kCapacity) {
        __syncthreads();
        found = collect_exact<T, Shape::kThreads>(row, width, k, threshold, max_key, buffer, &count, kCapacity,
                                                  storage.count, storage.scan);
        __syncthreads();
      }
    }
    uint64_t* candidates = buffer;
    if (collected && found <= kCapacity / 2) {
      // pass 1 collected from a floor below T: only the elements >= T (at least k, all of the
      // top k, every tie of the k-th value among them) go to the sort, in the upper half
      if (threadIdx.x == 0) count = 0;
      __syncthreads();
      candidates = buffer + kCapacity / 2;
      for (int i = threadIdx.x; i < found; i += blockDim.x) {
        const uint64_t entry = buffer[i];
        const bool keep = static_cast<uint32_t>(entry >> 32) >= threshold;
        if (keep) {
          cg::coalesced_group keeping = cg::coalesced_threads();
          unsigned int base = 0;
          if (keeping.thread_rank() == 0) base = atomicAdd(&count, keeping.size());
          candidates[keeping.shfl(base, 0) + keeping.thread_rank()] = entry;
        }
      }
      __syncthreads();
      found = static_cast<int>(count);
    }
    const int size = next_power_of_two(found);
    for (int i = found + threadIdx.x; i < size; i += blockDim.x) candidates[i] = 0;
    __syncthreads();
    sort_descending(candidates, size);

    const int valid = min(k, found);
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
      float value = -INFINITY;
      int32_t column = 0;
      if (j < valid) {
        const uint64_t entry = candidates[j];
        value = __fdiv_rn(key_value(static_cast<uint32_t>(entry >> 32)), temperature);
        column = static_cast<int32_t>(~static_cast<uint32_t>(entry));
      }
      values[r * k + j] = value;
      indices[r * k + j] = column;
    }
    __syncthreads();
  }
}

template <typename T, typename Shape>
cudaError_t launch_shape(const void* logits, int64_t rows, int64_t row_stride, int64_t width, int64_t k,
                         float temperature, float* values, int32_t* indices, float* lse, cudaStream_t stream) {
  const int shared_bytes = Shape::kCapacity * sizeof(uint64_t) + (kPipelined<T> ? kStages * Shape::kThreads * 16 : 0);
  const cudaError_t attribute = cudaFuncSetAttribute(topk_candidates_kernel<T, Shape>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  if (attribute != cudaSuccess) return attribute;
  int device = 0, processors = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  // persistent blocks filling the SMs: a block carries the previous row's threshold to the next
  const int64_t blocks = std::min<int64_t>(rows, Shape::kBlocksPerSM * static_cast<int64_t>(processors));
  topk_candidates_kernel<T, Shape><<<static_cast<unsigned int>(blocks), Shape::kThreads, shared_bytes, stream>>>(
      static_cast<const T*>(logits), rows, row_stride, static_cast<int>(width), static_cast<int>(k), temperature,
      values, indices, lse);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const void* logits, int64_t rows, int64_t row_stride, int64_t width, int64_t k, float temperature,
                   float* values, int32_t* indices, float* lse, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (k <= kNarrowMaxTopK && (kNarrowFor16Bit<T> || width <= kNarrowMaxFloat32Width)) {
    return launch_shape<T, Narrow>(logits, rows, row_stride, width, k, temperature, values, indices, lse, stream);
  }
  return launch_shape<T, Wide>(logits, rows, row_stride, width, k, temperature, values, indices, lse, stream);
}

}  // namespace

cudaError_t launch_topk_candidates(LogitsDtype dtype, const void* logits, int64_t rows, int64_t row_stride,
                                   int64_t width, int64_t k, float temperature, float* values, int32_t* indices,
                                   float* lse, cudaStream_t stream) {
  switch (dtype) {
    case LogitsDtype::kFloat32:
      return launch<float>(logits, rows, row_stride, width, k, temperature, values, indices, lse, stream);
    case LogitsDtype::kFloat16:
      return launch<__half>(logits, rows, row_stride, width, k, temperature, values, indices, lse, stream);
    case LogitsDtype::kBFloat16:
      return launch<__nv_bfloat16>(logits, rows, row_stride, width, k, temperature, values, indices, lse, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kd_kernels
