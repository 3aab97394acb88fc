// Python bindings: shape checks and tensor <-> pointer plumbing around kernels.h.
// Kept apart from the kernels so only this file pays for the heavy torch headers.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <tuple>

#include "kernels.h"

namespace rebar_cpu_quant {
namespace {

struct QuantizedBuffers {
  at::Tensor q, d, group_sums;

  QuantizedRows view() const {
    return {q.data_ptr<int8_t>(), d.data_ptr<float>(),
            group_sums.defined() ? group_sums.data_ptr<float>() : nullptr, q.size(0), d.size(1)};
  }
};

// blocks_per_group == 0: no group sums (the int8 kernel has no offset term).
QuantizedBuffers quantize(const at::Tensor& x, int64_t num_blocks, int64_t blocks_per_group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [rows, in]");
  TORCH_CHECK(x.size(1) <= num_blocks * kBlock, "x has more columns than the weight");
  const int64_t rows = x.size(0);
  QuantizedBuffers out;
  out.q = at::empty({rows, num_blocks * kBlock}, x.options().dtype(at::kChar));
  out.d = at::empty({rows, num_blocks}, x.options());
  if (blocks_per_group > 0) {
    TORCH_CHECK(num_blocks % blocks_per_group == 0, "groups must tile the row");
    out.group_sums = at::empty({rows, num_blocks / blocks_per_group}, x.options());
  }
  quantize_rows(x.data_ptr<float>(), rows, x.size(1), num_blocks, blocks_per_group, out.q.data_ptr<int8_t>(),
                out.d.data_ptr<float>(), out.group_sums.defined() ? out.group_sums.data_ptr<float>() : nullptr);
  return out;
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

at::Tensor int4_linear_packed(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t out_features) {
  const PackedWeights w = packed_view(codes, scales, &offsets, 16, out_features);
  TORCH_CHECK(x.size(1) == w.num_blocks * kBlock, "x must have ", w.num_blocks * kBlock, " columns");
  const QuantizedBuffers xq = quantize(x, w.num_blocks, w.blocks_per_group);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  int4_linear(xq.view(), w, y.data_ptr<float>(), at::get_num_threads());
  return y;
}

at::Tensor int8_linear_packed(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              int64_t out_features) {
  const PackedWeights w = packed_view(codes, scales, nullptr, 32, out_features);
  // Per-channel int8 weights may have a ragged last block: x keeps its real width.
  TORCH_CHECK(x.size(1) > (w.num_blocks - 1) * kBlock, "x has too few columns for the weight");
  const QuantizedBuffers xq = quantize(x, w.num_blocks, 0);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  int8_linear(xq.view(), w, y.data_ptr<float>(), at::get_num_threads());
  return y;
}

// For tests: the exact int8 activations and block scales the kernels compute with.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x, int64_t blocks_per_group) {
  const int64_t num_blocks = (x.size(1) + kBlock - 1) / kBlock;
  QuantizedBuffers out = quantize(x, num_blocks, blocks_per_group);
  return {out.q, out.d, out.group_sums};
}

}  // namespace
}  // namespace rebar_cpu_quant

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear_packed", &rebar_cpu_quant::int4_linear_packed, "y = x @ w.T for packed int4 weights");
  m.def("int8_linear_packed", &rebar_cpu_quant::int8_linear_packed, "y = x @ w.T for packed int8 weights");
  m.def("quantize_activations", &rebar_cpu_quant::quantize_activations,
        "x -> (int8 codes, per-block scales, per-group sums)");
}
