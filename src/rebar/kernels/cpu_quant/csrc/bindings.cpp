// Python bindings: shape checks and tensor <-> pointer plumbing around kernels.h.
// Kept apart from the kernels so only this file pays for the heavy torch headers (and only for
// ATen and the pybind glue: torch/extension.h would add the whole C++ frontend to the compile).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace rebar_cpu_quant {
namespace {

// The quantized activations of one call. Thread-local scratch (a call runs on one caller thread
// and finishes before returning), so a decode step does not allocate for them.
struct QuantizedScratch {
  std::vector<int8_t> q;
  std::vector<float> d, group_sums;
};

// blocks_per_group == 0: no group sums (the int8 kernel has no offset term).
QuantizedRows quantize(const at::Tensor& x, int64_t num_blocks, int64_t blocks_per_group) {
  thread_local QuantizedScratch scratch;
  const int64_t in = x.size(-1), rows = x.numel() / std::max<int64_t>(in, 1);
  scratch.q.resize(rows * num_blocks * kBlock);
  scratch.d.resize(rows * num_blocks);
  float* group_sums = nullptr;
  if (blocks_per_group > 0) {
    scratch.group_sums.resize(rows * (num_blocks / blocks_per_group));
    group_sums = scratch.group_sums.data();
  }
  quantize_rows(x.data_ptr<float>(), rows, in, num_blocks, blocks_per_group, scratch.q.data(), scratch.d.data(),
                group_sums);
  return {scratch.q.data(), scratch.d.data(), group_sums, rows, num_blocks};
}

// x [..., in] float32 on the CPU, as a contiguous tensor.
at::Tensor checked_input(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU tensor, got ",
                    x.scalar_type(), " on ", x.device());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == in_features, "x must be [..., ", in_features, "], got ",
                    x.sizes());
  return x.contiguous();
}

at::Tensor output_like(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return at::empty(shape, x.options());
}

PackedWeights packed_view(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor* offsets,
                          int64_t block_bytes, int64_t out_features) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kTileRows && codes.size(3) == block_bytes && codes.is_contiguous(),
              "codes must be contiguous [tiles, blocks, 8, ", block_bytes, "]");
  TORCH_CHECK(codes.element_size() == 1, "codes must be 8-bit");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(2) == kTileRows &&
                  scales.is_contiguous() && (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "scales must be contiguous float32/float16 [tiles, groups, 8]");
  TORCH_CHECK(codes.size(1) % scales.size(1) == 0, "groups must tile the row");
  TORCH_CHECK(out_features > (codes.size(0) - 1) * kTileRows && out_features <= codes.size(0) * kTileRows,
              "out_features does not match the number of tiles");
  if (offsets) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == scales.scalar_type() &&
                    offsets->is_contiguous(),
                "offsets must match scales in shape and dtype");
  }
  return {codes.data_ptr(), scales.data_ptr(), offsets ? offsets->data_ptr() : nullptr,
          scales.scalar_type() == at::kHalf, codes.size(0), codes.size(1),
          codes.size(1) / scales.size(1), out_features};
}

// Threads for one call: every OpenMP region ends in a barrier, and on a busy machine a barrier can wait
// a whole scheduler time slice (milliseconds) for a descheduled thread. A decode step makes ~200 small
// calls, so only calls with enough work to amortise that risk are split; the rest run on one thread.
constexpr int64_t kMinMacsPerThread = int64_t{4} << 20;

int threads_for(const PackedWeights& w, int64_t rows) {
  const int64_t macs = w.num_tiles * 8 * w.num_blocks * kBlock * rows;
  const int64_t wanted = std::max<int64_t>(1, macs / kMinMacsPerThread);
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), wanted));
}

at::Tensor int4_linear_packed(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t out_features) {
  const PackedWeights w = packed_view(codes, scales, &offsets, 16, out_features);
  const at::Tensor x = checked_input(x_in, w.num_blocks * kBlock);
  at::Tensor y = output_like(x, out_features);
  if (y.numel() > 0) int4_linear(quantize(x, w.num_blocks, w.blocks_per_group), w, y.data_ptr<float>(), threads_for(w, x.size(0)));
  return y;
}

at::Tensor int8_linear_packed(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                              int64_t out_features, int64_t in_features) {
  const PackedWeights w = packed_view(codes, scales, nullptr, 32, out_features);
  // Per-channel int8 weights may have a ragged last block: x keeps its real width.
  TORCH_CHECK(in_features > (w.num_blocks - 1) * kBlock && in_features <= w.num_blocks * kBlock,
              "in_features does not match the packed codes");
  const at::Tensor x = checked_input(x_in, in_features);
  at::Tensor y = output_like(x, out_features);
  if (y.numel() > 0) int8_linear(quantize(x, w.num_blocks, 0), w, y.data_ptr<float>(), threads_for(w, x.size(0)));
  return y;
}

// For tests: the exact int8 activations and block scales the kernels compute with, as
// (q [rows, blocks * 32], d [rows, blocks], group sums [rows, groups] or None).
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> quantize_activations(const at::Tensor& x_in,
                                                                                 int64_t blocks_per_group) {
  const at::Tensor x = checked_input(x_in, x_in.size(-1)).reshape({-1, x_in.size(-1)});
  const int64_t num_blocks = (x.size(1) + kBlock - 1) / kBlock;
  TORCH_CHECK_VALUE(blocks_per_group == 0 || num_blocks % blocks_per_group == 0, "groups must tile the row");
  const QuantizedRows q = quantize(x, num_blocks, blocks_per_group);
  const auto copy = [](const auto* data, std::vector<int64_t> shape, at::ScalarType type) {
    return at::from_blob(const_cast<void*>(static_cast<const void*>(data)), shape, at::TensorOptions(type)).clone();
  };
  std::optional<at::Tensor> sums;
  if (q.group_sums) sums = copy(q.group_sums, {q.rows, num_blocks / blocks_per_group}, at::kFloat);
  return {copy(q.q, {q.rows, num_blocks * kBlock}, at::kChar), copy(q.d, {q.rows, num_blocks}, at::kFloat), sums};
}

}  // namespace
}  // namespace rebar_cpu_quant

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear_packed", &rebar_cpu_quant::int4_linear_packed, "y = x @ w.T for packed int4 weights");
  m.def("int8_linear_packed", &rebar_cpu_quant::int8_linear_packed, "y = x @ w.T for packed int8 weights");
  m.def("quantize_activations", &rebar_cpu_quant::quantize_activations,
        "x -> (int8 codes, per-block scales, per-group sums)");
}
