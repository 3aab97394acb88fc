// Per-block int8 quantization of activation rows (the "Q8" side of the dot products).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels.h"

namespace rebar_cpu_quant {
namespace {

float horizontal_max(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

int32_t horizontal_sum(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(h);
}

// A float rounded to float16 and back (to nearest, ties to even: llama.cpp's GGML_FP32_TO_FP16).
float to_half_and_back(float value) { return _cvtsh_ss(_cvtss_sh(value, 0)); }

// 32 floats -> 32 int8 with q = round(x * 127 / max|x|) (ties to even, the default rounding mode),
// and the sums of q over each half of 16 (for the zero points of kSuperSym weights).
// Returns the sum of the rounded block, d * sum(q), which the weight-offset terms multiply: with
// x's rounding error left out of them, the result is exactly the weights times the rounded
// activations, whose error is that rounding weighted by the (centred) weights. Exact sums of x
// would weight it by the codes alone, 0..15 steps instead of -8..7 for Q4_1: about twice the error.
// With `half_scales`, d and that sum are returned rounded to float16 (quantize_rows in kernels.h).
float quantize_block(const float* x, int8_t* q, float* d, int32_t* half_sums, bool half_scales) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_andnot_ps(sign_bit, v[0]);
  for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
  const float max_abs = horizontal_max(amax);
  const float exact_d = max_abs / 127.0f;
  *d = half_scales ? to_half_and_back(exact_d) : exact_d;
  const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);

  __m256i ints[4];
  for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // The packs work within 128-bit halves, so the 4-byte groups come out as
  // [v0 0-3, v1 0-3, v2 0-3, v3 0-3, v0 4-7, v1 4-7, v2 4-7, v3 4-7]; the permute restores order.
  const __m256i words = _mm256_packs_epi32(ints[0], ints[1]);
  const __m256i words2 = _mm256_packs_epi32(ints[2], ints[3]);
  const __m256i bytes = _mm256_packs_epi16(words, words2);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  half_sums[0] = horizontal_sum(_mm256_add_epi32(ints[0], ints[1]));  // |q| <= 127: nothing saturated
  half_sums[1] = horizontal_sum(_mm256_add_epi32(ints[2], ints[3]));
  const float sum = exact_d * static_cast<float>(half_sums[0] + half_sums[1]);
  return half_scales ? to_half_and_back(sum) : sum;
}

}  // namespace

void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t num_blocks, int64_t blocks_per_sum, int8_t* q,
                   float* d, float* group_sums, int32_t* half_sums, bool half_scales) {
  const int64_t full_blocks = in / kBlock;
  const int64_t num_groups = group_sums ? num_blocks / blocks_per_sum : 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x_row = x + r * in;
    int8_t* q_row = q + r * num_blocks * kBlock;
    float* d_row = d + r * num_blocks;
    int32_t* half_row = half_sums + r * num_blocks * 2;
    float* sums_row = group_sums ? group_sums + r * num_groups : nullptr;
    if (sums_row) std::fill(sums_row, sums_row + num_groups, 0.0f);
    for (int64_t b = 0; b < num_blocks; ++b) {
      float block_sum;
      if (b < full_blocks) {
        block_sum = quantize_block(x_row + b * kBlock, q_row + b * kBlock, d_row + b, half_row + 2 * b, half_scales);
      } else {  // the ragged end of the row (or pure padding): zero-fill a copy
        float padded[kBlock] = {};
        const int64_t start = b * kBlock;
        if (start < in) std::memcpy(padded, x_row + start, sizeof(float) * (in - start));
        block_sum = quantize_block(padded, q_row + b * kBlock, d_row + b, half_row + 2 * b, half_scales);
      }
      if (sums_row) sums_row[b / blocks_per_sum] += block_sum;
    }
  }
}

}  // namespace rebar_cpu_quant
