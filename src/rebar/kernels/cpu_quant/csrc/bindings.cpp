// Python bindings: shape checks and tensor <-> pointer plumbing around kernels.h.
// Kept apart from the kernels so only this file pays for the heavy torch headers (and only for
// ATen and the pybind glue: torch/extension.h would add the whole C++ frontend to the compile).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "decoder.h"
#include "elementwise.h"
#include "worker_pool.h"
#include "best_outputs.h"
#include "block_dots.h"
#include "kernels.h"
#include "simd.h"

namespace rebar_cpu_quant {
namespace {

// The quantized activations of one call. Thread-local scratch (a call runs on one caller thread
// and finishes before returning), so a decode step does not allocate for them.
struct QuantizedScratch {
  std::vector<int8_t> q;
  std::vector<float> d, group_sums;
  std::vector<int32_t> half_sums;
};

constexpr int64_t kQuantizeGrainRows = 64;

// blocks_per_sum == 0: no float sums (only the affine kinds' offsets need them). half_scales: see
// quantize_rows (kernels.h).
QuantizedRows quantize(const at::Tensor& x, int64_t num_blocks, int64_t blocks_per_sum, bool half_scales) {
  thread_local QuantizedScratch scratch;
  const int64_t in = x.size(-1), rows = x.numel() / std::max<int64_t>(in, 1);
  scratch.q.resize(rows * num_blocks * kBlock);
  scratch.d.resize(rows * num_blocks);
  scratch.half_sums.resize(rows * num_blocks * 2);
  const int64_t num_groups = blocks_per_sum > 0 ? num_blocks / blocks_per_sum : 0;
  float* group_sums = nullptr;
  if (blocks_per_sum > 0) {
    scratch.group_sums.resize(rows * num_groups);
    group_sums = scratch.group_sums.data();
  }
  // Rows are independent: a prefill's activations are quantized on torch's threads (below the
  // grain, on this one). The lambda must not name `scratch`: on another thread that is its own.
  const float* x_data = x.data_ptr<float>();
  int8_t* q = scratch.q.data();
  float* d = scratch.d.data();
  int32_t* half_sums = scratch.half_sums.data();
  at::parallel_for(0, rows, kQuantizeGrainRows, [&](int64_t begin, int64_t end) {
    quantize_rows(x_data + begin * in, end - begin, in, num_blocks, blocks_per_sum, q + begin * num_blocks * kBlock,
                  d + begin * num_blocks, group_sums ? group_sums + begin * num_groups : nullptr,
                  half_sums + begin * num_blocks * 2, half_scales);
  });
  return {q, d, group_sums, half_sums, rows, num_blocks};
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

// A packed weight as Python hands it over (packing.py's `kernel_args`):
// (kind, code_bits, codes, scales, offsets or None, sub_scales or None, zero_point, out_features,
//  in_features).
using WeightArgs = std::tuple<int64_t, int64_t, at::Tensor, at::Tensor, std::optional<at::Tensor>,
                              std::optional<at::Tensor>, int64_t, int64_t, int64_t>;

// Checks every shape and dtype (a bad layout must fail here, never read out of bounds) and returns
// the weight's view for the kernels, plus its in_features.
PackedWeights packed_view(const WeightArgs& args, int64_t* in_features = nullptr) {
  const auto& [kind_value, bits, codes, scales, offsets, sub_scales, zero_point, out, in] = args;
  TORCH_CHECK_VALUE(kind_value >= 0 && kind_value <= 3, "unknown weight kind ", kind_value);
  const auto kind = static_cast<WeightKind>(kind_value);
  const bool is_super = kind >= WeightKind::kSuperAffine;
  const bool bits_ok = kind == WeightKind::kSuperSym ? bits == 6
                       : kind == WeightKind::kSym    ? bits == 4 || bits == 5 || bits == 8
                                                     : bits == 4 || bits == 5;
  TORCH_CHECK_VALUE(bits_ok, "weight kind ", kind_value, " does not take ", bits, "-bit codes");
  const bool zero_point_ok = kind == WeightKind::kSym || kind == WeightKind::kSuperSym
                                 ? zero_point >= 0 && zero_point < (int64_t{1} << bits)
                                 : zero_point == 0;
  TORCH_CHECK_VALUE(zero_point_ok, "zero point ", zero_point, " does not suit weight kind ", kind_value);
  TORCH_CHECK_VALUE(codes.dim() == 4 && codes.size(2) == bits && codes.size(3) == 32 && codes.is_contiguous() &&
                        codes.scalar_type() == at::kByte,
                    "codes must be contiguous uint8 [tiles, blocks, ", bits, ", 32], got ", codes.scalar_type(), " ",
                    codes.sizes());
  TORCH_CHECK_VALUE(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(2) == kTileRows &&
                        scales.is_contiguous() && scales.size(1) > 0 && codes.size(1) % scales.size(1) == 0,
                    "scales must be contiguous [tiles, groups, 8] with groups tiling the row, got ", scales.sizes());
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK_VALUE(half || (scales.scalar_type() == at::kFloat && !is_super),
                    "scales must be float16 (or float32 for the per-group kinds), got ", scales.scalar_type());
  const int64_t groups = scales.size(1), per_group = codes.size(1) / groups;
  const bool wants_offsets = kind == WeightKind::kAffine || kind == WeightKind::kSuperAffine;
  TORCH_CHECK_VALUE(offsets.has_value() == wants_offsets, "weight kind ", kind_value,
                    wants_offsets ? " needs offsets" : " has no offsets");
  if (offsets) {
    TORCH_CHECK_VALUE(offsets->sizes() == scales.sizes() && offsets->scalar_type() == scales.scalar_type() &&
                          offsets->is_contiguous(),
                      "offsets must match scales in shape and dtype");
  }
  TORCH_CHECK_VALUE(sub_scales.has_value() == is_super, "sub_scales are given exactly for the super-block kinds");
  if (sub_scales) {
    // kSuperAffine: 96 bytes of packed 6-bit pairs per tile and super-block; kSuperSym: 16 x 8 int8.
    const bool packed_pairs = kind == WeightKind::kSuperAffine;
    const std::vector<int64_t> expected = packed_pairs ? std::vector<int64_t>{codes.size(0), groups, kKScaleBytes}
                                                       : std::vector<int64_t>{codes.size(0), groups, 2 * per_group, kTileRows};
    TORCH_CHECK_VALUE(sub_scales->sizes() == expected && sub_scales->is_contiguous() && sub_scales->element_size() == 1,
                      "sub_scales must be contiguous 8-bit ", at::IntArrayRef(expected), ", got ", sub_scales->sizes());
  }
  TORCH_CHECK_VALUE(out > (codes.size(0) - 1) * kTileRows && out <= codes.size(0) * kTileRows,
                    "out_features does not match the number of tiles");
  // Rows may end in a ragged block only with one scale per row (rebar's per-channel int8): the
  // activations' padding is zero, so the padded codes never count.
  TORCH_CHECK_VALUE(in > (codes.size(1) - 1) * kBlock && in <= codes.size(1) * kBlock &&
                        (groups == 1 || in == codes.size(1) * kBlock),
                    "in_features does not match the packed codes");
  if (in_features) *in_features = in;
  return {kind,
          static_cast<int>(bits),
          static_cast<const uint8_t*>(codes.data_ptr()),
          scales.data_ptr(),
          offsets ? offsets->data_ptr() : nullptr,
          sub_scales ? static_cast<const uint8_t*>(sub_scales->data_ptr()) : nullptr,
          half,
          static_cast<int>(zero_point),
          codes.size(0),
          codes.size(1),
          per_group,
          out};
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

// Runs chunk(c, num_chunks) for each of the chunks one linear's tiles split into (linear_chunks), on
// the pool its rows call for; returns how many chunks there were.
int64_t run_linear_chunks(const LinearJob& job, int64_t rows, const std::function<void(int64_t, int64_t)>& chunk) {
  const int num_threads = threads_for(*job.w, rows);
  const int64_t num_chunks = linear_chunks(&job, 1, num_threads);
  if (num_threads > 1 && rows >= kMinRowsForTorchPool) {
    at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) chunk(c, num_chunks);
    });
  } else {
    WorkerPool::shared(num_threads).run(num_chunks, num_threads, [&](int64_t c) { chunk(c, num_chunks); });
  }
  return num_chunks;
}

void run_linear(const LinearJob& job, int64_t rows) {
  run_linear_chunks(job, rows, [&](int64_t c, int64_t num_chunks) { run_linear_chunk(&job, 1, c, num_chunks); });
}

at::Tensor linear_packed(const at::Tensor& x_in, const WeightArgs& weight) {
  int64_t in_features = 0;
  const PackedWeights w = packed_view(weight, &in_features);
  const at::Tensor x = checked_input(x_in, in_features);
  at::Tensor y = output_like(x, w.out_features);
  if (y.numel() > 0) {
    const QuantizedRows rows = quantize(x, w.num_blocks, blocks_per_sum(w), half_activation_scales(w));
    run_linear({&rows, &w, y.data_ptr<float>()}, rows.rows);
  }
  return y;
}

// Each row's first largest output of x @ w.T and whether it is finite with no NaN in the row, as
// best_logits(linear_packed(x, w)) finds them, without writing the outputs: x [rows, in] float32 ->
// (int64 [rows], bool [rows]).
std::tuple<at::Tensor, at::Tensor> best_outputs_op(const at::Tensor& x_in, const WeightArgs& weight) {
  int64_t in_features = 0;
  const PackedWeights w = packed_view(weight, &in_features);
  const at::Tensor x = checked_input(x_in, in_features);
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [rows, ", in_features, "], got ", x.sizes());
  const int64_t rows = x.size(0);
  at::Tensor index = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor finite = at::empty({rows}, x.options().dtype(at::kBool));
  if (rows == 0) return {index, finite};
  const QuantizedRows q = quantize(x, w.num_blocks, blocks_per_sum(w), half_activation_scales(w));
  const LinearJob job{&q, &w, nullptr};
  const int64_t most_chunks = linear_chunks(&job, 1, at::get_num_threads());
  std::vector<BestValue> chunk_bests(most_chunks * rows);
  std::vector<float> buffers(most_chunks * best_outputs_buffer_floats(rows));
  const int64_t num_chunks = run_linear_chunks(job, rows, [&](int64_t c, int64_t num_chunks) {
    const TileRange tiles = chunk_tiles(w.num_tiles, c, num_chunks);
    best_outputs_range(q, w, tiles.begin, tiles.end, buffers.data() + c * best_outputs_buffer_floats(rows),
                       chunk_bests.data() + c * rows);
  });
  std::vector<BestValue> best(rows);
  merge_best_outputs(chunk_bests.data(), num_chunks, rows, best.data());
  int64_t* out = index.data_ptr<int64_t>();
  bool* ok = finite.data_ptr<bool>();
  for (int64_t r = 0; r < rows; ++r) {
    out[r] = best[r].index;
    ok[r] = !best[r].nan && std::isfinite(best[r].value);
  }
  return {index, finite};
}

// For tests: the exact int8 activations and block scales the kernels compute with, as
// (q [rows, blocks * 32], d [rows, blocks], group sums [rows, groups] or None, half-block sums of q
// [rows, blocks * 2]).
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor> quantize_activations(
    const at::Tensor& x_in, int64_t blocks_per_sum, bool half_scales) {
  const at::Tensor x = checked_input(x_in, x_in.size(-1)).reshape({-1, x_in.size(-1)});
  const int64_t num_blocks = (x.size(1) + kBlock - 1) / kBlock;
  TORCH_CHECK_VALUE(blocks_per_sum >= 0 && (blocks_per_sum == 0 || num_blocks % blocks_per_sum == 0),
                    "groups must tile the row");
  const QuantizedRows q = quantize(x, num_blocks, blocks_per_sum, half_scales);
  const auto copy = [](const auto* data, std::vector<int64_t> shape, at::ScalarType type) {
    return at::from_blob(const_cast<void*>(static_cast<const void*>(data)), shape, at::TensorOptions(type)).clone();
  };
  std::optional<at::Tensor> sums;
  if (q.group_sums) sums = copy(q.group_sums, {q.rows, num_blocks / blocks_per_sum}, at::kFloat);
  return {copy(q.q, {q.rows, num_blocks * kBlock}, at::kChar), copy(q.d, {q.rows, num_blocks}, at::kFloat), sums,
          copy(q.half_sums, {q.rows, num_blocks * 2}, at::kInt)};
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

// Sets logits[rows[j], i] = -inf wherever bit i of bitmask[j] is clear: logits [batch, vocab]
// float32 and contiguous, bitmask [len(rows), >= ceil(vocab / 32)] int32, rows int64. Returns how
// many tokens each row still allows (int64 [len(rows)]).
at::Tensor mask_logits_op(at::Tensor& logits, const at::Tensor& bitmask_in, const at::Tensor& rows_in) {
  check_float_cpu(logits, "logits");
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.is_contiguous(), "logits must be [batch, vocab] and contiguous");
  TORCH_CHECK_VALUE(bitmask_in.scalar_type() == at::kInt && bitmask_in.dim() == 2 && bitmask_in.device().is_cpu(),
                    "bitmask must be an int32 [rows, words] CPU tensor");
  TORCH_CHECK_VALUE(rows_in.scalar_type() == at::kLong && rows_in.dim() == 1 && rows_in.size(0) == bitmask_in.size(0),
                    "rows must be int64 [", bitmask_in.size(0), "], got ", rows_in.sizes());
  const int64_t vocab = logits.size(1), batch = logits.size(0);
  TORCH_CHECK_VALUE(bitmask_in.size(1) * 32 >= vocab, "bitmask has ", bitmask_in.size(1), " words for ", vocab,
                    " logits");
  const at::Tensor bitmask = bitmask_in.contiguous(), rows = rows_in.contiguous();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.size(0); ++j) {
    TORCH_CHECK_VALUE(row_ids[j] >= 0 && row_ids[j] < batch, "row ", row_ids[j], " is outside [0, ", batch, ")");
  }
  float* out = logits.data_ptr<float>();
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  const int64_t words = bitmask.size(1);
  at::Tensor allowed = at::empty({rows.size(0)}, rows.options());
  int64_t* counts = allowed.data_ptr<int64_t>();
  // On the calling thread: a row takes microseconds, less than waking torch's threads would.
  for (int64_t j = 0; j < rows.size(0); ++j) counts[j] = mask_logits(out + row_ids[j] * vocab, mask + j * words, vocab);
  return allowed;
}

// Each row's first largest logit (torch.argmax's index) and whether it is a finite value in a row
// without NaN: logits [rows, vocab] float32 -> (int64 [rows], bool [rows]).
std::tuple<at::Tensor, at::Tensor> best_logits_op(const at::Tensor& logits_in) {
  check_float_cpu(logits_in, "logits");
  TORCH_CHECK_VALUE(logits_in.dim() == 2 && logits_in.size(1) > 0, "logits must be [rows, vocab > 0], got ",
                    logits_in.sizes());
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor index = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor finite = at::empty({rows}, logits.options().dtype(at::kBool));
  const float* data = logits.data_ptr<float>();
  int64_t* out = index.data_ptr<int64_t>();
  bool* ok = finite.data_ptr<bool>();
  // A 262k-token row takes ~90 us: one alone on the calling thread, several (a step checking drafts)
  // split by rows over the worker pool, whose helpers the step's matmuls just used.
  const int num_threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), rows));
  if (num_threads <= 1) {
    for (int64_t r = 0; r < rows; ++r) out[r] = best_logit(data + r * vocab, vocab, ok + r);
  } else {
    WorkerPool::shared(num_threads).run(rows, num_threads, [&](int64_t r) { out[r] = best_logit(data + r * vocab, vocab, ok + r); });
  }
  return {index, finite};
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

// (weight, bias or None)
using LinearArgs = std::tuple<WeightArgs, std::optional<at::Tensor>>;

void check_float_vector(const at::Tensor& t, int64_t size, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 1 && t.size(0) == size &&
                        t.is_contiguous(),
                    name, " must be a contiguous float32 CPU vector of ", size, ", got ", t.scalar_type(), " ",
                    t.sizes());
}

// Holds (references to) every layer's weights and KV cache; `step` runs one decode step over them.
class FusedDecoder {
 public:
  // activation: 0 SiLU, 1 tanh-GELU.
  FusedDecoder(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               double norm_eps, double attn_scale, int64_t sliding_window, int64_t activation) {
    TORCH_CHECK_VALUE(hidden > 0 && head_dim > 0 && head_dim % 8 == 0 && intermediate > 0 && num_kv_heads > 0 &&
                          num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= kMaxGroupSize &&
                          sliding_window >= 0 && (activation == 0 || activation == 1),
                      "invalid decoder shape");
    shape_ = {hidden, num_heads, num_kv_heads, head_dim, intermediate, 0, 0,
              static_cast<float>(norm_eps), static_cast<float>(attn_scale), sliding_window, CacheKind::kFloat32,
              static_cast<Activation>(activation)};
  }

  // The norms in `optional_norms` (q_norm, k_norm, attn_out_norm, mlp_out_norm) may each be None;
  // q_norm and k_norm come together. `windowed` layers attend over the sliding window, `local_rope`
  // ones rotate with the step's local tables.
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_attn_norm, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const std::vector<LinearArgs>& linears,
                 const std::vector<std::optional<at::Tensor>>& optional_norms, bool windowed, bool local_rope) {
    const DecoderShape& s = shape_;
    check_float_vector(input_norm, s.hidden, "input_norm");
    check_float_vector(post_attn_norm, s.hidden, "post_attn_norm");
    // A uint8 cache holds Q8_0 rows: head_dim / 32 blocks of 34 bytes (rebar.kernels.kv_quant).
    const bool q8 = key_cache.scalar_type() == at::kByte;
    const int64_t row = q8 ? s.head_dim / 32 * 34 : s.head_dim;
    TORCH_CHECK_VALUE(!q8 || s.head_dim % 32 == 0, "a Q8_0 KV cache needs head_dim a multiple of 32, got ",
                      s.head_dim);
    for (const at::Tensor* cache : {&key_cache, &value_cache}) {
      const at::ScalarType type = cache->scalar_type();
      TORCH_CHECK_VALUE((type == at::kFloat || type == at::kHalf || type == at::kByte) && cache->device().is_cpu() &&
                            cache->dim() == 4 && cache->is_contiguous() && cache->size(2) == s.num_kv_heads &&
                            cache->size(3) == row,
                        "KV caches must be contiguous float32, float16 or Q8_0 (uint8) [blocks, block_size, ",
                        s.num_kv_heads, ", ", row, "], got ", type, " ", cache->sizes());
    }
    TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == value_cache.scalar_type(),
                      "key and value caches differ in shape or dtype");
    const CacheKind kind = q8 ? CacheKind::kQ8_0
                              : (key_cache.scalar_type() == at::kHalf ? CacheKind::kFloat16 : CacheKind::kFloat32);
    if (layers_.empty()) {
      shape_.num_blocks = key_cache.size(0);
      shape_.block_size = key_cache.size(1);
      shape_.cache = kind;
    }
    TORCH_CHECK_VALUE(key_cache.size(0) == s.num_blocks && key_cache.size(1) == s.block_size && kind == s.cache,
                      "every layer's KV cache must have the same blocks and dtype");
    TORCH_CHECK_VALUE(linears.size() == 7, "expected the 7 linears q, k, v, o, gate, up, down");
    const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
    const int64_t shapes[7][2] = {{q_size, s.hidden}, {kv_size, s.hidden}, {kv_size, s.hidden}, {s.hidden, q_size},
                                  {s.intermediate, s.hidden}, {s.intermediate, s.hidden}, {s.hidden, s.intermediate}};
    QuantLinearRef refs[7];
    for (int i = 0; i < 7; ++i) refs[i] = linear_ref(linears[i], shapes[i][0], shapes[i][1]);
    DecoderLayerRef layer{input_norm.data_ptr<float>(), post_attn_norm.data_ptr<float>(), refs[0], refs[1], refs[2],
                          refs[3], refs[4], refs[5], refs[6], key_cache.data_ptr(), value_cache.data_ptr()};
    TORCH_CHECK_VALUE(optional_norms.size() == 4, "expected the 4 optional norms q, k, attention out, MLP out");
    TORCH_CHECK_VALUE(optional_norms[0].has_value() == optional_norms[1].has_value(), "q and k norms come together");
    const int64_t norm_sizes[4] = {s.head_dim, s.head_dim, s.hidden, s.hidden};
    const float** targets[4] = {&layer.q_norm, &layer.k_norm, &layer.attn_out_norm, &layer.mlp_out_norm};
    for (int i = 0; i < 4; ++i) {
      if (!optional_norms[i]) continue;
      check_float_vector(*optional_norms[i], norm_sizes[i], "a layer norm");
      *targets[i] = optional_norms[i]->data_ptr<float>();
      keep_alive_.push_back(*optional_norms[i]);
    }
    TORCH_CHECK_VALUE(!windowed || s.sliding_window > 0, "a windowed layer needs the decoder's sliding window");
    layer.windowed = windowed;
    layer.local_rope = local_rope;
    layers_.push_back(layer);
    for (const at::Tensor& t : {input_norm, post_attn_norm, key_cache, value_cache}) keep_alive_.push_back(t);
  }

  // x [rows, hidden] float32 is updated in place from the embeddings to the last layer's output.
  // cos/sin are the global layers' RoPE tables, local_cos/local_sin the local layers' (the same
  // tensors when every layer shares one).
  void step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& local_cos,
            const at::Tensor& local_sin, const at::Tensor& slots, const at::Tensor& block_tables,
            const std::vector<int64_t>& context_lens) {
    const DecoderShape& s = shape_;
    TORCH_CHECK_VALUE(!layers_.empty(), "the decoder has no layers");
    const int64_t rows = x.dim() == 2 ? x.size(0) : -1;
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous() && rows >= 0 &&
                          x.size(1) == s.hidden,
                      "x must be a contiguous float32 CPU tensor [rows, ", s.hidden, "], got ", x.sizes());
    for (const at::Tensor* t : {&cos, &sin, &local_cos, &local_sin}) {
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
    const DecodeBatch batch{x.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>(),
                            local_cos.data_ptr<float>(), local_sin.data_ptr<float>(), slot_data, tables, width,
                            context_lens.data()};
    const int num_threads = at::get_num_threads();
    pybind11::gil_scoped_release no_gil;  // the engine thread computes while the server thread serves
    decode_layers(s, layers_, batch, num_threads);
  }

 private:
  QuantLinearRef linear_ref(const LinearArgs& args, int64_t out_features, int64_t in_features) {
    const auto& [weight, bias] = args;
    int64_t in = 0;
    const PackedWeights w = packed_view(weight, &in);
    TORCH_CHECK_VALUE(w.out_features == out_features && in == in_features, "linear is [", w.out_features, ", ", in,
                      "], expected [", out_features, ", ", in_features, "]");
    const float* bias_data = nullptr;
    if (bias) {
      check_float_vector(*bias, out_features, "bias");
      bias_data = bias->data_ptr<float>();
      keep_alive_.push_back(*bias);
    }
    const auto& [kind, bits, codes, scales, offsets, sub_scales, zero_point, out, in_] = weight;
    for (const at::Tensor& t : {codes, scales}) keep_alive_.push_back(t);
    for (const auto* t : {&offsets, &sub_scales}) {
      if (t->has_value()) keep_alive_.push_back(**t);
    }
    return {w, in, bias_data};
  }

  DecoderShape shape_{};
  std::vector<DecoderLayerRef> layers_;
  std::vector<at::Tensor> keep_alive_;  // the tensors layers_ points into
};

}  // namespace
}  // namespace rebar_cpu_quant

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every computing function runs without the GIL (its arguments are converted before, its result
  // after): a prompt chunk computing beside the decode steps, the server's event loop and the
  // embedding thread then never wait for one of these calls to finish before they run Python.
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("linear_packed", &rebar_cpu_quant::linear_packed, "y = x @ w.T for a packed quantized weight", no_gil);
  m.def("quantize_activations", &rebar_cpu_quant::quantize_activations,
        "x -> (int8 codes, per-block scales, per-group sums, half-block sums)", no_gil);
  m.def("isa", [] { return std::string(rebar_cpu_quant::isa_name()); }, "the integer instruction set built for");
  m.def("silu_and_mul", &rebar_cpu_quant::silu_and_mul_op, "silu(gate) * up", no_gil);
  m.def("mask_logits_", &rebar_cpu_quant::mask_logits_op, "-inf where a row's token bitmask has a clear bit",
        no_gil);
  m.def("best_outputs", &rebar_cpu_quant::best_outputs_op,
        "each row's argmax of x @ w.T and whether its best is finite, without writing the outputs", no_gil);
  m.def("best_logits", &rebar_cpu_quant::best_logits_op, "each row's argmax and whether its best is finite",
        no_gil);
  m.def("rope_", &rebar_cpu_quant::rope_op, "rotates x [tokens, heads, head_dim] in place by cos and sin", no_gil);
  pybind11::class_<rebar_cpu_quant::FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t, int64_t>())
      .def("add_layer", &rebar_cpu_quant::FusedDecoder::add_layer)
      .def("step", &rebar_cpu_quant::FusedDecoder::step);
}
