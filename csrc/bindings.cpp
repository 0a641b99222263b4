// pybind11 adapter of the CUDA kernels: checks every input itself (the Python layer checks
// too, but this entry point is public as kd_kernels._C), allocates outputs, launches on the
// current stream of the input's device.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "sort_keys.h"
#include "topk_candidates.h"

namespace {

// Input errors are raised as Python ValueError / TypeError by pybind11 itself, with messages
// built from std::to_string: on the GPU image, a TORCH_CHECK whose message streams an integer
// crashed the interpreter (segfault) instead of raising.
[[noreturn]] void fail_value(const std::string& message) { throw pybind11::value_error(message); }
[[noreturn]] void fail_type(const std::string& message) { throw pybind11::type_error(message); }

std::string shape_of(const at::Tensor& tensor) {
  std::string text = "[";
  for (int64_t d = 0; d < tensor.dim(); ++d) text += (d ? ", " : "") + std::to_string(tensor.size(d));
  return text + "]";
}

kd_kernels::LogitsDtype logits_dtype(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat:
      return kd_kernels::LogitsDtype::kFloat32;
    case at::kHalf:
      return kd_kernels::LogitsDtype::kFloat16;
    case at::kBFloat16:
      return kd_kernels::LogitsDtype::kBFloat16;
    default:
      fail_type(std::string("logits: expected dtype float32, float16 or bfloat16, got ") +
                c10::toString(logits.scalar_type()));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_candidates(const at::Tensor& logits, int64_t k,
                                                               double temperature, int64_t width) {
  if (!logits.is_cuda()) fail_value("logits: expected a CUDA tensor, got one on " + logits.device().str());
  if (logits.dim() != 2) fail_value("logits: expected 2 dimensions [rows, columns], got shape " + shape_of(logits));
  const auto dtype = logits_dtype(logits);
  if (logits.size(1) > 1 && logits.stride(1) != 1) {
    fail_value("logits: expected contiguous rows (stride(1) == 1), got stride(1) = " +
               std::to_string(logits.stride(1)));
  }
  if (k < 1 || k > kd_kernels::kMaxTopK) {
    fail_value("k: expected 1 <= k <= " + std::to_string(kd_kernels::kMaxTopK) + ", got " + std::to_string(k));
  }
  if (width < 1 || width > logits.size(1)) {
    fail_value("width: expected 1 <= width <= logits.size(1) = " + std::to_string(logits.size(1)) + ", got " +
               std::to_string(width));
  }
  if (width > std::numeric_limits<int32_t>::max()) fail_value("width: expected < 2^31, got " + std::to_string(width));
  if (!std::isfinite(temperature) || temperature <= 0) {
    fail_value("temperature: expected a finite value > 0, got " + std::to_string(temperature));
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  const auto float_options = logits.options().dtype(at::kFloat);
  at::Tensor values = at::empty({rows, k}, float_options);
  at::Tensor indices = at::empty({rows, k}, logits.options().dtype(at::kInt));
  at::Tensor lse = at::empty({rows}, float_options);
  const int64_t row_stride = rows > 1 ? logits.stride(0) : logits.size(1);
  const cudaError_t status = kd_kernels::launch_topk_candidates(
      dtype, logits.data_ptr(), rows, row_stride, width, k, static_cast<float>(temperature),
      values.data_ptr<float>(), indices.data_ptr<int32_t>(), lse.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream().stream());
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("topk_candidates: CUDA launch failed: ") + cudaGetErrorString(status));
  }
  return {values, indices, lse};
}

void check_int32_rows(const at::Tensor& tensor, const char* name, const at::Tensor& like, int64_t rows, int dims) {
  if (tensor.device() != like.device() || tensor.scalar_type() != at::kInt || tensor.dim() != dims ||
      tensor.size(0) != rows || !tensor.is_contiguous()) {
    fail_value(std::string(name) + ": expected a contiguous int32 tensor of " + std::to_string(dims) +
               " dimension(s) with " + std::to_string(rows) + " rows on " + like.device().str() + ", got " +
               c10::toString(tensor.scalar_type()) + " " + shape_of(tensor) + " on " + tensor.device().str());
  }
}

std::tuple<at::Tensor, at::Tensor> sort_keys(const at::Tensor& keys, const at::Tensor& counts, int64_t k) {
  if (!keys.is_cuda()) fail_value("keys: expected a CUDA tensor, got one on " + keys.device().str());
  if (keys.scalar_type() != at::kLong) {
    fail_type(std::string("keys: expected dtype int64, got ") + c10::toString(keys.scalar_type()));
  }
  if (keys.dim() != 2 || !keys.is_contiguous()) {
    fail_value("keys: expected a contiguous [rows, capacity] tensor, got shape " + shape_of(keys));
  }
  const int64_t rows = keys.size(0), capacity = keys.size(1);
  if (capacity < 1 || capacity > kd_kernels::kMaxSortKeys) {
    fail_value("keys: expected 1 <= keys.size(1) <= " + std::to_string(kd_kernels::kMaxSortKeys) + ", got " +
               std::to_string(capacity));
  }
  check_int32_rows(counts, "counts", keys, rows, 1);
  if (k < 1 || k > capacity) {
    fail_value("k: expected 1 <= k <= keys.size(1) = " + std::to_string(capacity) + ", got " + std::to_string(k));
  }
  const c10::cuda::CUDAGuard guard(keys.device());
  at::Tensor values = at::empty({rows, k}, keys.options().dtype(at::kFloat));
  at::Tensor columns = at::empty({rows, k}, keys.options().dtype(at::kInt));
  const cudaError_t status = kd_kernels::launch_sort_keys(
      keys.data_ptr<int64_t>(), counts.data_ptr<int32_t>(), rows, capacity, k, values.data_ptr<float>(),
      columns.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream().stream());
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("sort_keys: CUDA launch failed: ") + cudaGetErrorString(status));
  }
  return {values, columns};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "kd_kernels CUDA kernels";
  module.attr("MAX_TOPK") = kd_kernels::kMaxTopK;
  module.def("topk_candidates", &topk_candidates,
             "Top-k of each logits row over its first `width` columns: (values [rows, k] float32 = logits / "
             "temperature, descending, lower column first on ties, -inf past width; indices [rows, k] int32; "
             "lse [rows] float32 = logsumexp(logits[:, :width] / temperature)).",
             pybind11::arg("logits"), pybind11::arg("k"), pybind11::arg("temperature"), pybind11::arg("width"));
  module.attr("MAX_SORT_KEYS") = kd_kernels::kMaxSortKeys;
  module.def("sort_keys", &sort_keys,
             "The k largest of each row's first counts[r] int64 keys as the appending matmul stores them (a float's "
             "bits above its column), in order: (values [rows, k] float32, descending, lower column first on ties, "
             "-inf past the count; columns [rows, k] int32, 0 there).",
             pybind11::arg("keys"), pybind11::arg("counts"), pybind11::arg("k"));
}
