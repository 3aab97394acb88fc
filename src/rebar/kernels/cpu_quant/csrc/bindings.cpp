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

#include "decoder.h"
#include "elementwise.h"
#include "kernels.h"

namespace rebar_cpu_quant {
namespace {

// The quantized activations of one call. Thread-local scratch (a call runs on one caller thread
// and finishes before returning), so a decode step does not allocate for them.
struct QuantizedScratch {
  std::vector<int8_t> q;
  std::vector<float> d, group_sums;
};

constexpr int64_t kQuantizeGrainRows = 64;

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
  const int64_t num_groups = blocks_per_group > 0 ? num_blocks / blocks_per_group : 0;
  // Rows are independent: a prefill's activations are quantized on torch's threads (below the
  // grain, on this one). The lambda must not name `scratch`: on another thread that is its own.
  const float* x_data = x.data_ptr<float>();
  int8_t* q = scratch.q.data();
  float* d = scratch.d.data();
  at::parallel_for(0, rows, kQuantizeGrainRows, [&](int64_t begin, int64_t end) {
    quantize_rows(x_data + begin * in, end - begin, in, num_blocks, blocks_per_group, q + begin * num_blocks * kBlock,
                  d + begin * num_blocks, group_sums ? group_sums + begin * num_groups : nullptr);
  });
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

// The codes' trailing dimensions per tile and block: int4 [4 chunks, 32 bytes], int8 [8 rows, 32 bytes].
PackedWeights packed_view(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor* offsets, int64_t bits,
                          int64_t out_features) {
  const int64_t inner = bits == 4 ? 4 : kTileRows;
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == inner && codes.size(3) == 32 && codes.is_contiguous(),
              "codes must be contiguous [tiles, blocks, ", inner, ", 32]");
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

// Threads for one call: waking a sleeping helper costs tens of microseconds, more than a small
// matmul takes on one thread, so only calls with enough work are split.
constexpr int64_t kMinMacsPerThread = int64_t{1} << 20;
// Prefill-sized calls (this many rows or more) run on torch's own thread pool instead of rebar's
// WorkerPool. A prefill interleaves these matmuls with torch ops (attention, norms) whose OpenMP
// threads keep spinning for a while after each op; a second pool's helpers would compete with them
// for the same cores (measured: a 512-token prefill at 2 threads lost a third of its matmul speed
// that way). Decode-sized calls (the lm_head of a decode step, say) keep the WorkerPool, whose
// helpers the fused decode step uses next and which never waits on a descheduled helper.
constexpr int64_t kMinRowsForTorchPool = 64;

int64_t macs_of(const PackedWeights& w, int64_t rows) { return w.num_tiles * 8 * w.num_blocks * kBlock * rows; }

int threads_for(const PackedWeights& w, int64_t rows) {
  const int64_t wanted = std::max<int64_t>(1, macs_of(w, rows) / kMinMacsPerThread);
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), wanted));
}

void run_linear(const LinearJob& job, int64_t rows) {
  const int num_threads = threads_for(*job.w, rows);
  if (num_threads > 1 && rows >= kMinRowsForTorchPool) {
    const int64_t num_chunks = linear_chunks(&job, 1, num_threads);
    at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) run_linear_chunk(&job, 1, chunk, num_chunks);
    });
  } else {
    run_linears(&job, 1, num_threads);
  }
}

at::Tensor int4_linear_packed(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t out_features) {
  const PackedWeights w = packed_view(codes, scales, &offsets, 4, out_features);
  const at::Tensor x = checked_input(x_in, w.num_blocks * kBlock);
  at::Tensor y = output_like(x, out_features);
  if (y.numel() > 0) {
    const QuantizedRows rows = quantize(x, w.num_blocks, w.blocks_per_group);
    run_linear({&rows, &w, 4, y.data_ptr<float>()}, rows.rows);
  }
  return y;
}

at::Tensor int8_linear_packed(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                              int64_t out_features, int64_t in_features) {
  const PackedWeights w = packed_view(codes, scales, nullptr, 8, out_features);
  // Per-channel int8 weights may have a ragged last block: x keeps its real width.
  TORCH_CHECK(in_features > (w.num_blocks - 1) * kBlock && in_features <= w.num_blocks * kBlock,
              "in_features does not match the packed codes");
  const at::Tensor x = checked_input(x_in, in_features);
  at::Tensor y = output_like(x, out_features);
  if (y.numel() > 0) {
    const QuantizedRows rows = quantize(x, w.num_blocks, 0);
    run_linear({&rows, &w, 8, y.data_ptr<float>()}, rows.rows);
  }
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

// ---- Element-wise steps of the model's own forward (elementwise.h) -----------------------------

// Split over torch's threads like the prefill matmuls around them; below these sizes, one thread.
constexpr int64_t kElementwiseGrainValues = 16384;
constexpr int64_t kRopeGrainTokens = 32;

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, " must be a float32 CPU tensor, got ",
                    t.scalar_type(), " on ", t.device());
}

// silu(gate) * up, a new tensor shaped like gate.
at::Tensor silu_and_mul_op(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_float_cpu(gate_in, "gate");
  check_float_cpu(up_in, "up");
  TORCH_CHECK_VALUE(gate_in.sizes() == up_in.sizes(), "gate and up differ in shape: ", gate_in.sizes(), " vs ",
                    up_in.sizes());
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty_like(gate, at::MemoryFormat::Contiguous);
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), kElementwiseGrainValues,
                   [&](int64_t begin, int64_t end) { silu_and_mul(g + begin, u + begin, o + begin, end - begin); });
  return out;
}

// Rotates x [tokens, heads, head_dim] (contiguous) in place by cos and sin [tokens, head_dim].
void rope_op(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_cpu(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.is_contiguous() && x.size(2) % 2 == 0,
                    "x must be a contiguous [tokens, heads, head_dim] tensor with an even head_dim, got ", x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  for (const at::Tensor* t : {&cos, &sin}) {
    check_float_cpu(*t, "cos and sin");
    TORCH_CHECK_VALUE(t->is_contiguous() && t->dim() == 2 && t->size(0) == tokens && t->size(1) == head_dim,
                      "cos and sin must be contiguous [", tokens, ", ", head_dim, "], got ", t->sizes());
  }
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, tokens, kRopeGrainTokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rope(data + t * heads * head_dim, heads, head_dim, c + t * head_dim, s + t * head_dim);
    }
  });
}


// ---- The fused decode step (decoder.h) ---------------------------------------------------------

// (bits, codes, scales, offsets (int4) or None, bias or None, out_features, in_features)
using LinearArgs = std::tuple<int64_t, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                              int64_t, int64_t>;

void check_float_vector(const at::Tensor& t, int64_t size, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 1 && t.size(0) == size &&
                        t.is_contiguous(),
                    name, " must be a contiguous float32 CPU vector of ", size, ", got ", t.scalar_type(), " ",
                    t.sizes());
}

// Holds (references to) every layer's weights and KV cache; `step` runs one decode step over them.
class FusedDecoder {
 public:
  FusedDecoder(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               double norm_eps, double attn_scale, int64_t sliding_window) {
    TORCH_CHECK_VALUE(hidden > 0 && head_dim > 0 && head_dim % 8 == 0 && intermediate > 0 && num_kv_heads > 0 &&
                          num_heads % num_kv_heads == 0 && sliding_window >= 0,
                      "invalid decoder shape");
    shape_ = {hidden, num_heads, num_kv_heads, head_dim, intermediate, 0, 0,
              static_cast<float>(norm_eps), static_cast<float>(attn_scale), sliding_window};
  }

  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_attn_norm, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const std::vector<LinearArgs>& linears) {
    const DecoderShape& s = shape_;
    check_float_vector(input_norm, s.hidden, "input_norm");
    check_float_vector(post_attn_norm, s.hidden, "post_attn_norm");
    for (const at::Tensor* cache : {&key_cache, &value_cache}) {
      const at::ScalarType type = cache->scalar_type();
      TORCH_CHECK_VALUE((type == at::kFloat || type == at::kHalf) && cache->device().is_cpu() && cache->dim() == 4 &&
                            cache->is_contiguous() && cache->size(2) == s.num_kv_heads && cache->size(3) == s.head_dim,
                        "KV caches must be contiguous float32 or float16 [blocks, block_size, ", s.num_kv_heads,
                        ", ", s.head_dim, "], got ", type, " ", cache->sizes());
    }
    TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == value_cache.scalar_type(),
                      "key and value caches differ in shape or dtype");
    const bool half = key_cache.scalar_type() == at::kHalf;
    if (layers_.empty()) {
      shape_.num_blocks = key_cache.size(0);
      shape_.block_size = key_cache.size(1);
      shape_.half_cache = half;
    }
    TORCH_CHECK_VALUE(key_cache.size(0) == s.num_blocks && key_cache.size(1) == s.block_size && half == s.half_cache,
                      "every layer's KV cache must have the same blocks and dtype");
    TORCH_CHECK_VALUE(linears.size() == 7, "expected the 7 linears q, k, v, o, gate, up, down");
    const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
    const int64_t shapes[7][2] = {{q_size, s.hidden}, {kv_size, s.hidden}, {kv_size, s.hidden}, {s.hidden, q_size},
                                  {s.intermediate, s.hidden}, {s.intermediate, s.hidden}, {s.hidden, s.intermediate}};
    QuantLinearRef refs[7];
    for (int i = 0; i < 7; ++i) refs[i] = linear_ref(linears[i], shapes[i][0], shapes[i][1]);
    layers_.push_back({input_norm.data_ptr<float>(), post_attn_norm.data_ptr<float>(), refs[0], refs[1], refs[2],
                       refs[3], refs[4], refs[5], refs[6], key_cache.data_ptr(), value_cache.data_ptr()});
    for (const at::Tensor& t : {input_norm, post_attn_norm, key_cache, value_cache}) keep_alive_.push_back(t);
  }

  // x [rows, hidden] float32 is updated in place from the embeddings to the last layer's output.
  void step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
            const at::Tensor& block_tables, const std::vector<int64_t>& context_lens) {
    const DecoderShape& s = shape_;
    TORCH_CHECK_VALUE(!layers_.empty(), "the decoder has no layers");
    const int64_t rows = x.dim() == 2 ? x.size(0) : -1;
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous() && rows >= 0 &&
                          x.size(1) == s.hidden,
                      "x must be a contiguous float32 CPU tensor [rows, ", s.hidden, "], got ", x.sizes());
    for (const at::Tensor* t : {&cos, &sin}) {
      TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == rows &&
                            t->size(1) == s.head_dim,
                        "cos and sin must be contiguous float32 [", rows, ", ", s.head_dim, "]");
    }
    TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                          slots.size(0) == rows,
                      "slots must be int64 [", rows, "]");
    TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                          block_tables.dim() == 2 && block_tables.size(0) == rows,
                      "block_tables must be contiguous int64 [", rows, ", width]");
    TORCH_CHECK_VALUE(static_cast<int64_t>(context_lens.size()) == rows, "one context length per row");
    const int64_t width = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* slot_data = slots.data_ptr<int64_t>();
    // Every cache address the step touches is checked here: a bad table must fail, never read or
    // write outside the cache.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t context = context_lens[r];
      TORCH_CHECK_VALUE(context >= 1 && context <= width * s.block_size, "row ", r, ": context length ", context,
                        " outside 1..", width * s.block_size);
      TORCH_CHECK_VALUE(slot_data[r] >= 0 && slot_data[r] < s.num_blocks * s.block_size, "row ", r, ": slot ",
                        slot_data[r], " outside the cache");
      for (int64_t b = 0; b * s.block_size < context; ++b) {
        const int64_t block = tables[r * width + b];
        TORCH_CHECK_VALUE(block >= 0 && block < s.num_blocks, "row ", r, ": block ", block, " outside the cache");
      }
    }
    const DecodeBatch batch{x.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>(), slot_data,
                            tables, width, context_lens.data()};
    const int num_threads = at::get_num_threads();
    pybind11::gil_scoped_release no_gil;  // the engine thread computes while the server thread serves
    decode_layers(s, layers_, batch, num_threads);
  }

 private:
  QuantLinearRef linear_ref(const LinearArgs& args, int64_t out_features, int64_t in_features) {
    const auto& [bits, codes, scales, offsets, bias, out, in] = args;
    TORCH_CHECK_VALUE(out == out_features && in == in_features, "linear is [", out, ", ", in, "], expected [",
                      out_features, ", ", in_features, "]");
    TORCH_CHECK_VALUE(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
    TORCH_CHECK_VALUE((bits == 4) == offsets.has_value(), "int4 linears need offsets, int8 ones have none");
    const PackedWeights w = packed_view(codes, scales, offsets ? &*offsets : nullptr, bits, out);
    TORCH_CHECK_VALUE(in > (w.num_blocks - 1) * kBlock && in <= w.num_blocks * kBlock &&
                          (bits == 8 || in == w.num_blocks * kBlock),
                      "in_features does not match the packed codes");
    const float* bias_data = nullptr;
    if (bias) {
      check_float_vector(*bias, out, "bias");
      bias_data = bias->data_ptr<float>();
      keep_alive_.push_back(*bias);
    }
    keep_alive_.push_back(codes);
    keep_alive_.push_back(scales);
    if (offsets) keep_alive_.push_back(*offsets);
    return {w, static_cast<int>(bits), in, bias_data};
  }

  DecoderShape shape_{};
  std::vector<DecoderLayerRef> layers_;
  std::vector<at::Tensor> keep_alive_;  // the tensors layers_ points into
};

}  // namespace
}  // namespace rebar_cpu_quant

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear_packed", &rebar_cpu_quant::int4_linear_packed, "y = x @ w.T for packed int4 weights");
  m.def("int8_linear_packed", &rebar_cpu_quant::int8_linear_packed, "y = x @ w.T for packed int8 weights");
  m.def("quantize_activations", &rebar_cpu_quant::quantize_activations,
        "x -> (int8 codes, per-block scales, per-group sums)");
  m.def("silu_and_mul", &rebar_cpu_quant::silu_and_mul_op, "silu(gate) * up");
  m.def("rope_", &rebar_cpu_quant::rope_op, "rotates x [tokens, heads, head_dim] in place by cos and sin");
  pybind11::class_<rebar_cpu_quant::FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("add_layer", &rebar_cpu_quant::FusedDecoder::add_layer)
      .def("step", &rebar_cpu_quant::FusedDecoder::step);
}
