// Two tiles side by side in one 512-bit register (AVX-512 builds): lanes 0..7 hold the first tile's
// 8 output rows, lanes 8..15 the next tile's, whose outputs follow the first's in y.
//
// Each lane does exactly what it does in block_dots.h's 256-bit arithmetic (the same integer dots,
// then the same float steps in the same order), so an output gets the same bits whether its tile
// went alone or in a pair. What a pair saves is per product: one broadcast of an activation dword,
// one scale product and one accumulate serve 16 outputs instead of 8. In the prefill schedule
// (quant_gemm.cpp), whose steps are compute-bound, that is most of the instructions beside the dot
// products themselves; the small-batch schedule measured slower with pairs (docs/kernels.md).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define REBAR_PAIRED_TILES 1

namespace rebar_cpu_quant {

inline __m512i join(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }

inline __m512 join(__m256 low, __m256 high) {
  const __m512d wide = _mm512_castps_pd(_mm512_castps256_ps512(low));
  return _mm512_castpd_ps(_mm512_insertf64x4(wide, _mm256_castps_pd(high), 1));
}

inline __m512i broadcast4_512(const int8_t* x) {
  int32_t bits;
  std::memcpy(&bits, x, 4);
  return _mm512_set1_epi32(bits);
}

// block_dots on a pair: code vectors w[0..8) against R rows' blocks (columns 0..15 into lo, 16..31
// into hi).
template <int R>
inline void pair_block_dots(const __m512i w[8], const int8_t* const x[R], __m512i lo[R], __m512i hi[R]) {
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_dpbusd_epi32(lo[r], w[k], broadcast4_512(x[r] + 4 * k));
      hi[r] = _mm512_dpbusd_epi32(hi[r], w[4 + k], broadcast4_512(x[r] + 16 + 4 * k));
    }
  }
}

// One block's scales for a pair: the group's (or the K-quant block's) scale, kSuperAffine's min,
// kSuperSym's two half-block scales.
struct PairBlockScales {
  __m512 scale;
  __m512 min;
  __m512i sub_lo, sub_hi;
};

// acc plus one row's term for one block, per kind: add_scaled_dot, add_sym_dot and add_sym16_dot of
// block_dots.h, then kSuperAffine's min term. `sums` are the row's two half-block code sums,
// `group_sum` its rounded block sum (kSuperAffine).
template <WeightKind kKind>
inline __m512 pair_block_term(__m512 acc, __m512i lo, __m512i hi, const PairBlockScales& s, const int32_t* sums,
                              int zero_point, float dx, float group_sum) {
  const __m512 scale_dx = _mm512_mul_ps(s.scale, _mm512_set1_ps(dx));
  if constexpr (kKind == WeightKind::kSuperSym) {
    const __m512i lo_dot = _mm512_mullo_epi32(_mm512_sub_epi32(lo, _mm512_set1_epi32(zero_point * sums[0])), s.sub_lo);
    const __m512i hi_dot = _mm512_mullo_epi32(_mm512_sub_epi32(hi, _mm512_set1_epi32(zero_point * sums[1])), s.sub_hi);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo_dot, hi_dot)), scale_dx, acc);
  }
  __m512i dot = _mm512_add_epi32(lo, hi);
  if constexpr (kKind == WeightKind::kSym) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(zero_point * (sums[0] + sums[1])));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale_dx, acc);
  if constexpr (kKind == WeightKind::kSuperAffine) acc = _mm512_fnmadd_ps(s.min, _mm512_set1_ps(group_sum), acc);
  return acc;
}

// R rows' blocks b against a pair: pair_block_dots, then each row's pair_block_term.
template <WeightKind kKind, int R>
inline void pair_block(const __m512i w[8], const PairBlockScales& s, const QuantizedRows& x, int64_t row, int64_t b,
                       int zero_point, __m512 acc[R]) {
  const int8_t* x_block[R];
  for (int r = 0; r < R; ++r) x_block[r] = x.q + ((row + r) * x.num_blocks + b) * kBlock;
  __m512i lo[R], hi[R];
  pair_block_dots<R>(w, x_block, lo, hi);
  for (int r = 0; r < R; ++r) {
    const int64_t at = (row + r) * x.num_blocks + b;
    const float group_sum = kKind == WeightKind::kSuperAffine ? x.group_sums[at] : 0.0f;
    acc[r] = pair_block_term<kKind>(acc[r], lo[r], hi[r], s, x.half_sums + at * 2, zero_point, x.d[at], group_sum);
  }
}

// kAffine's offset term of group g, added after every block: acc + offset * the row's rounded sum
// over the group.
template <int R>
inline void pair_offset(__m512 offset, const QuantizedRows& x, int64_t row, int64_t g, int64_t num_groups,
                        __m512 acc[R]) {
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.group_sums[(row + r) * num_groups + g]), acc[r]);
  }
}

// The pair's outputs of R rows (its 16 lanes, fewer where the weight ends).
template <int R>
inline void store_pair(const PackedWeights& w, int64_t first_tile, int64_t row, const __m512 acc[R], float* y) {
  const int64_t first_out = first_tile * kTileRows;
  const int64_t count = std::min<int64_t>(2 * kTileRows, w.out_features - first_out);
  const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (row + r) * w.out_features + first_out, lanes, acc[r]);
}

}  // namespace rebar_cpu_quant

#endif
