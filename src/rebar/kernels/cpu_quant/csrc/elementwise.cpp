#include "elementwise.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "simd.h"

namespace rebar_cpu_quant {

void silu_and_mul(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    alignas(32) float lanes[8] = {-gate[i]};
    _mm256_store_ps(lanes, exp256(_mm256_load_ps(lanes)));
    out[i] = gate[i] / (1.0f + lanes[0]) * up[i];
  }
}

// gelu(g) = g / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3), with tanh(u) = 1 - 2 / (1 + e^(2u));
// u is clamped to +-15 first, where tanh is 1 to float32 precision and e^(2u) stays finite.
inline __m256 gelu_tanh8(__m256 g) {
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(u, _mm256_set1_ps(-15.0f)), _mm256_set1_ps(15.0f));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp256(_mm256_add_ps(clamped, clamped));
  const __m256 tanh_u = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(one, e)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, tanh_u));
}

void gelu_tanh_and_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu_tanh8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {  // the ragged end, through zero-padded copies
    alignas(32) float g[8] = {}, u[8] = {};
    std::memcpy(g, gate + i, sizeof(float) * (n - i));
    std::memcpy(u, up + i, sizeof(float) * (n - i));
    _mm256_store_ps(g, _mm256_mul_ps(gelu_tanh8(_mm256_load_ps(g)), _mm256_load_ps(u)));
    std::memcpy(out + i, g, sizeof(float) * (n - i));
  }
}

void rope(float* x, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

}  // namespace rebar_cpu_quant

namespace rebar_cpu_quant {

int64_t mask_logits(float* logits, const int32_t* bitmask, int64_t n) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const int64_t num_words = (n + 31) / 32;
  int64_t allowed = 0;
  for (int64_t w = 0; w < num_words; ++w) {
    const int64_t begin = w * 32, count = std::min<int64_t>(32, n - begin);
    // Bits past the vocabulary's end (in the last word) count for nothing.
    const uint32_t in_range = count == 32 ? 0xFFFFFFFFu : ((1u << count) - 1u);
    const uint32_t word = static_cast<uint32_t>(bitmask[w]) & in_range;
    allowed += __builtin_popcount(word);
    if (word == in_range) continue;
    float* out = logits + begin;
    if (word == 0) {
      std::fill(out, out + count, minus_inf);
      continue;
    }
    if (count == 32) {  // a fixed-length select, which the compiler turns into vector blends
      for (int b = 0; b < 32; ++b) out[b] = ((word >> b) & 1u) ? out[b] : minus_inf;
      continue;
    }
    for (int64_t b = 0; b < count; ++b) out[b] = ((word >> b) & 1u) ? out[b] : minus_inf;
  }
  return allowed;
}

BestValue best_value(const float* logits, int64_t n) {
  // Each lane keeps its first largest value and where it was (a strict comparison keeps the
  // first); of the lanes holding the overall best, the lowest index is the row's first.
  const float minus_inf = -std::numeric_limits<float>::infinity();
  __m256 best = _mm256_set1_ps(minus_inf), unordered = _mm256_setzero_ps();
  __m256i where = _mm256_setzero_si256(), index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(logits + i);
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // false for NaN
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_blendv_ps(best, v, greater);
    where = _mm256_blendv_epi8(where, index, _mm256_castps_si256(greater));
    index = _mm256_add_epi32(index, eight);
  }
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_where[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_where), where);
  BestValue out{0, minus_inf, _mm256_movemask_ps(unordered) != 0};
  for (int lane = 0; lane < 8; ++lane) {
    if (lane_best[lane] > out.value ||
        (lane_best[lane] == out.value && lane_where[lane] < out.index && out.value > minus_inf)) {
      out.value = lane_best[lane];
      out.index = lane_where[lane];
    }
  }
  for (; i < n; ++i) {  // the tail, after every vector: later indices win only when larger
    if (logits[i] != logits[i]) out.nan = true;
    if (logits[i] > out.value) out.value = logits[i], out.index = i;
  }
  return out;
}

int64_t best_logit(const float* logits, int64_t n, bool* finite) {
  const BestValue best = best_value(logits, n);
  *finite = !best.nan && std::isfinite(best.value);
  return best.index;
}

}  // namespace rebar_cpu_quant
