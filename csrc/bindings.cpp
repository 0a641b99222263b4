// pybind11 adapter of the CUDA kernels: checks every input itself (the Python layer checks
// too, but this entry point is public as kd_kernels._C), allocates outputs, launches on the
// current stream.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "topk_candidates.h"

namespace {

kd_kernels::LogitsDtype logits_dtype(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat:
      return kd_kernels::LogitsDtype::kFloat32;
    case at::kHalf:
      return kd_kernels::LogitsDtype::kFloat16;
    case at::kBFloat16:
      return kd_kernels::LogitsDtype::kBFloat16;
    default:
      TORCH_CHECK(false, "logits: expected dtype float32, float16 or bfloat16, got ", logits.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_candidates(const at::Tensor& logits, int64_t k,
                                                               double temperature, int64_t width) {
  TORCH_CHECK(logits.is_cuda(), "logits: expected a CUDA tensor, got one on ", logits.device());
  TORCH_CHECK(logits.dim() == 2, "logits: expected 2 dimensions [rows, columns], got ", logits.dim());
  const auto dtype = logits_dtype(logits);
  TORCH_CHECK(logits.size(1) == 0 || logits.stride(1) == 1,
              "logits: expected contiguous rows (stride(1) == 1), got stride(1) = ", logits.stride(1));
  TORCH_CHECK(k >= 1 && k <= kd_kernels::kMaxTopK, "k: expected 1 <= k <= ", kd_kernels::kMaxTopK, ", got ", k);
  TORCH_CHECK(width >= 1 && width <= logits.size(1), "width: expected 1 <= width <= logits.size(1) = ",
              logits.size(1), ", got ", width);
  TORCH_CHECK(width <= std::numeric_limits<int32_t>::max(), "width: expected < 2^31, got ", width);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "temperature: expected a finite value > 0, got ",
              temperature);
  TORCH_CHECK(logits.size(0) <= std::numeric_limits<int32_t>::max(), "logits: expected < 2^31 rows, got ",
              logits.size(0));
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  const auto float_options = logits.options().dtype(at::kFloat);
  at::Tensor values = at::empty({rows, k}, float_options);
  at::Tensor indices = at::empty({rows, k}, logits.options().dtype(at::kInt));
  at::Tensor lse = at::empty({rows}, float_options);
  const int64_t row_stride = rows > 1 ? logits.stride(0) : logits.size(1);
  C10_CUDA_CHECK(kd_kernels::launch_topk_candidates(
      dtype, logits.data_ptr(), rows, row_stride, width, k, static_cast<float>(temperature),
      values.data_ptr<float>(), indices.data_ptr<int32_t>(), lse.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream().stream()));
  return {values, indices, lse};
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
}
