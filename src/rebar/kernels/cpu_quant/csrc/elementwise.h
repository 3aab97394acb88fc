// Element-wise steps of a decoder layer in AVX2: SiLU- and GELU-and-multiply, rotary embeddings. Shared by
// the fused decode step (decoder.cpp) and the model's own prefill path (bindings.cpp).
#pragma once

#include <cstdint>

namespace rebar_cpu_quant {

// out[i] = silu(gate[i]) * up[i] = gate[i] * up[i] / (1 + e^-gate[i]), for i in [0, n). out may be gate.
void silu_and_mul(const float* gate, const float* up, float* out, int64_t n);

// out[i] = gelu(gate[i]) * up[i] with GELU's tanh approximation (Gemma's GeGLU). out may be gate.
void gelu_tanh_and_mul(const float* gate, const float* up, float* out, int64_t n);

// Rotates the `num_heads` heads of one token in place (the half-split layout: element i pairs with
// i + head_dim / 2) by that token's cos and sin rows ([head_dim] each).
void rope(float* x, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin);

}  // namespace rebar_cpu_quant

namespace rebar_cpu_quant {

// Sets logits[i] = -inf for every i in [0, n) whose bit is clear in `bitmask` (bit i % 32 of word
// i / 32, as token-mask libraries write it). Words with every bit set are skipped, words with none
// are filled at once: a grammar's mask is mostly one or the other. Returns how many stay allowed.
int64_t mask_logits(float* logits, const int32_t* bitmask, int64_t n);

// The first largest of logits[0, n) (torch.argmax's choice when there is no NaN): its index and value
// (0 and -inf when every value is -inf or NaN), and whether any value is NaN.
struct BestValue {
  int64_t index;
  float value;
  bool nan;
};
BestValue best_value(const float* logits, int64_t n);

// The index of the first largest of logits[0, n) (torch.argmax's choice), in one vectorised pass;
// `finite` says whether that value is finite and the row holds no NaN (for a row holding NaN the
// index is that of the largest of the other values, 0 if there are none).
int64_t best_logit(const float* logits, int64_t n, bool* finite);

}  // namespace rebar_cpu_quant
