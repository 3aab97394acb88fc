// Every decoder layer of a Llama-family model for one decode step, in one call.
//
// A decode step of a small model is thousands of tiny operations (norms, RoPE, cache writes,
// attention over a few hundred keys, residual adds) around seven matmuls per layer; dispatched one
// by one from Python, their overhead costs several times the matmuls themselves. Here the whole
// stack is one C++ call: the matmuls split their output tiles and attention its (row, head) pairs
// across a WorkerPool (worker_pool.h), and the small element-wise steps run on the calling thread.
//
// Per layer, for every row (one new token of one sequence):
//   h = rms_norm(x) * input_norm;  q, k, v = h Wq^T, h Wk^T, h Wv^T (+ biases)
//   [q, k = rms_norm(each head) * q_norm, k_norm];  RoPE on q, k (the layer's table: global or local)
//   K/V written at the row's cache slot;  a = softmax(q K^T * scale) V over the row's (windowed) context
//   o = a Wo^T (+ bias) [o = rms_norm(o) * attn_out_norm];  x += o
//   h = rms_norm(x) * post_attn_norm;  m = (act(h Wg^T) * (h Wu^T)) Wd^T [m = rms_norm(m) * mlp_out_norm];  x += m
// with act SiLU or tanh-GELU; the bracketed steps are the Llama family's variations (Qwen 3, Gemma 3).
// with the same int8 activation rounding and the same kernels as the unfused quantized linears, for
// every weight kind of kernels.h.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace rebar_cpu_quant {

// Most query heads sharing one KV head (grouped-query attention) that the fused step takes.
constexpr int64_t kMaxGroupSize = 64;

struct QuantLinearRef {
  PackedWeights weights;
  int64_t in_features;  // columns of x the layer reads (int8 per-channel rows may be ragged)
  const float* bias;    // [out_features] or null
};

struct DecoderLayerRef {
  const float* input_norm;      // [hidden]
  const float* post_attn_norm;  // [hidden]: the MLP's input norm
  QuantLinearRef q, k, v, o, gate, up, down;
  void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim] values, in the shape's CacheKind
  void* value_cache;  // same shape and kind
  const float* q_norm = nullptr;         // [head_dim] or null
  const float* k_norm = nullptr;         // [head_dim] or null
  const float* attn_out_norm = nullptr;  // [hidden] or null
  const float* mlp_out_norm = nullptr;   // [hidden] or null
  bool windowed = false;    // attends over the shape's sliding window (else the whole context)
  bool local_rope = false;  // rotates with the batch's local table (else the global one)
};

enum class Activation : int { kSilu = 0, kGeluTanh = 1 };

// How K/V are stored: float32, float16 (IEEE half, as torch.float16), or Q8_0 blocks of 32 values
// (rebar.kernels.kv_quant; head_dim a multiple of 32).
enum class CacheKind : int { kFloat32 = 0, kFloat16 = 1, kQ8_0 = 2 };

struct DecoderShape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t num_blocks, block_size;
  float norm_eps, attn_scale;
  int64_t sliding_window;  // windowed layers see keys with position > query position - window; 0: none
  CacheKind cache;
  Activation activation;
};

// One decode step's rows, already checked by the caller: slots and the blocks the contexts use are
// inside the cache, 1 <= context_lens[r] <= table_width * block_size.
struct DecodeBatch {
  float* x;  // [rows, hidden]: the embeddings in, the last layer's output out
  int64_t rows;
  const float* cos;               // [rows, head_dim], the half-split ("rotate_half") layout
  const float* sin;               // [rows, head_dim]
  const float* local_cos;         // the local layers' tables (the same pointers when they share one)
  const float* local_sin;
  const int64_t* slots;           // [rows]: where each row's new K/V go
  const int64_t* block_tables;    // [rows, table_width]
  int64_t table_width;
  const int64_t* context_lens;    // [rows]: keys each row attends over, its own included
};

void decode_layers(const DecoderShape& shape, const std::vector<DecoderLayerRef>& layers, const DecodeBatch& batch,
                   int num_threads);

}  // namespace rebar_cpu_quant
