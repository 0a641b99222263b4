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

#include "softmax_row_pass.h"
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

void check_cuda_tensor(const at::Tensor& tensor, const std::string& name, const at::Tensor& logits,
                       at::ScalarType dtype, int64_t rows) {
  if (!tensor.is_cuda() || tensor.device() != logits.device()) {
    fail_value(name + ": expected a CUDA tensor on " + logits.device().str() + ", got one on " +
               tensor.device().str());
  }
  if (tensor.scalar_type() != dtype) {
    fail_type(name + ": expected dtype " + c10::toString(dtype) + ", got " + c10::toString(tensor.scalar_type()));
  }
  if (tensor.dim() < 1 || tensor.size(0) != rows) {
    fail_value(name + ": expected " + std::to_string(rows) + " rows, got shape " + shape_of(tensor));
  }
  if (tensor.stride(-1) != 1 && tensor.size(-1) > 1) fail_value(name + ": expected unit stride in its last dimension");
}

const int64_t* optional_int64(const c10::optional<at::Tensor>& tensor) {
  return tensor.has_value() ? tensor->data_ptr<int64_t>() : nullptr;
}

// The student's row pass: statistics of float32 logits rows and the dense gradient written
// over them (see softmax_row_pass.h). Outputs are given (the caller's RowStatistics).
void softmax_row_pass(const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t width,
                      double inv_temperature, const c10::optional<at::Tensor>& ids,
                      const c10::optional<at::Tensor>& labels, const at::Tensor& coef, const at::Tensor& lse,
                      const at::Tensor& lse_tempered, const at::Tensor& best, const at::Tensor& top1,
                      const c10::optional<at::Tensor>& at_ids, const c10::optional<at::Tensor>& at_label,
                      const at::Tensor& grad) {
  if (!logits.is_cuda()) fail_value("logits: expected a CUDA tensor, got one on " + logits.device().str());
  if (logits.scalar_type() != at::kFloat) {
    fail_type(std::string("logits: expected dtype float32, got ") + c10::toString(logits.scalar_type()));
  }
  if (logits.dim() != 2) fail_value("logits: expected 2 dimensions [rows, columns], got shape " + shape_of(logits));
  const int64_t rows = logits.size(0), num_columns = logits.size(1);
  const int64_t row_stride = rows > 1 ? logits.stride(0) : (num_columns + 3) / 4 * 4;
  if ((num_columns > 1 && logits.stride(1) != 1) || row_stride % 4 != 0 ||
      reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 != 0) {
    fail_value("logits: expected unit column stride, a row stride that is a multiple of 4 and a 16-byte aligned "
               "start, got strides (" + std::to_string(logits.stride(0)) + ", " + std::to_string(logits.stride(1)) +
               ")");
  }
  const int64_t storage_floats = static_cast<int64_t>(logits.storage().nbytes() / 4) - logits.storage_offset();
  if (rows > 0 && (rows - 1) * row_stride + (num_columns + 3) / 4 * 4 > storage_floats) {
    fail_value("logits: the last row's columns rounded up to a multiple of 4 must lie inside its storage");
  }
  if (num_columns > kd_kernels::softmax_row_pass_max_columns()) {
    fail_value("logits: expected at most " + std::to_string(kd_kernels::softmax_row_pass_max_columns()) +
               " columns, got " + std::to_string(num_columns));
  }
  if (width < 1 || width > num_columns) {
    fail_value("width: expected 1 <= width <= " + std::to_string(num_columns) + ", got " + std::to_string(width));
  }
  if (!std::isfinite(inv_temperature) || inv_temperature <= 0) {
    fail_value("inv_temperature: expected a finite value > 0, got " + std::to_string(inv_temperature));
  }
  if (bias.has_value()) {
    check_cuda_tensor(*bias, "bias", logits, at::kFloat, bias->size(0));
    if (bias->dim() != 1 || bias->size(0) < width) {
      fail_value("bias: expected shape [>= width = " + std::to_string(width) + "], got " + shape_of(*bias));
    }
  }
  int64_t k = 0;
  if (ids.has_value()) {
    check_cuda_tensor(*ids, "ids", logits, at::kLong, rows);
    if (ids->dim() != 2 || !at_ids.has_value()) fail_value("ids: expected [rows, k] int64, with at_ids");
    k = ids->size(1);
    check_cuda_tensor(*at_ids, "at_ids", logits, at::kFloat, rows);
    if (at_ids->dim() != 2 || at_ids->size(1) != k) fail_value("at_ids: expected [rows, k] float32");
  }
  if (labels.has_value()) {
    check_cuda_tensor(*labels, "labels", logits, at::kLong, rows);
    if (!at_label.has_value()) fail_value("labels: expected at_label with them");
    check_cuda_tensor(*at_label, "at_label", logits, at::kFloat, rows);
  }
  check_cuda_tensor(coef, "coef", logits, at::kFloat, rows);
  check_cuda_tensor(lse, "lse", logits, at::kFloat, rows);
  check_cuda_tensor(lse_tempered, "lse_tempered", logits, at::kFloat, rows);
  check_cuda_tensor(best, "best", logits, at::kFloat, rows);
  check_cuda_tensor(top1, "top1", logits, at::kLong, rows);
  if (grad.scalar_type() != at::kFloat && grad.scalar_type() != at::kHalf && grad.scalar_type() != at::kBFloat16) {
    fail_type(std::string("grad: expected dtype float32, float16 or bfloat16, got ") +
              c10::toString(grad.scalar_type()));
  }
  const auto grad_dtype = logits_dtype(grad);
  check_cuda_tensor(grad, "grad", logits, grad.scalar_type(), rows);
  if (grad.dim() != 2 || grad.size(1) != num_columns || reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16 != 0 ||
      (rows > 1 && (grad.stride(0) * grad.element_size()) % 16 != 0)) {
    fail_value("grad: expected [rows, " + std::to_string(num_columns) +
               "], 16-byte aligned rows, got shape " + shape_of(grad));
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaError_t status = kd_kernels::launch_softmax_row_pass(
      logits.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr, rows, row_stride, width,
      num_columns, static_cast<float>(inv_temperature), ids.has_value() ? ids->data_ptr<int64_t>() : nullptr, k,
      ids.has_value() ? ids->stride(0) : 0, optional_int64(labels), coef.data_ptr<float>(), lse.data_ptr<float>(),
      lse_tempered.data_ptr<float>(), best.data_ptr<float>(), top1.data_ptr<int64_t>(),
      at_ids.has_value() ? at_ids->data_ptr<float>() : nullptr, at_ids.has_value() ? at_ids->stride(0) : 0,
      at_label.has_value() ? at_label->data_ptr<float>() : nullptr, grad_dtype, grad.data_ptr(),
      rows > 1 ? grad.stride(0) : 0, c10::cuda::getCurrentCUDAStream().stream());
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("softmax_row_pass: CUDA launch failed: ") + cudaGetErrorString(status));
  }
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
  module.attr("ROW_PASS_MAX_COLUMNS") = kd_kernels::softmax_row_pass_max_columns();
  module.def("softmax_row_pass", &softmax_row_pass,
             "Statistics of float32 logits rows (lse, lse_tempered, best, top1, at_ids, at_label: written into the "
             "given tensors) and grad = coef * softmax(logits[:, :width]) written over them (grad may alias logits): "
             "one read of each row, held by a cluster of CTAs.",
             pybind11::arg("logits"), pybind11::arg("bias"), pybind11::arg("width"), pybind11::arg("inv_temperature"),
             pybind11::arg("ids"), pybind11::arg("labels"), pybind11::arg("coef"), pybind11::arg("lse"),
             pybind11::arg("lse_tempered"), pybind11::arg("best"), pybind11::arg("top1"), pybind11::arg("at_ids"),
             pybind11::arg("at_label"), pybind11::arg("grad"));
}
