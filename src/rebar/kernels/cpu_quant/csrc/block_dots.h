// The arithmetic of one tile (8 output rows) and one block of 32 columns, shared by the small-batch
// schedule (quant_linear.cpp) and the prefill one (quant_gemm.cpp): both call these same inline
// functions in the same order, so a row gets the same bits whichever of them computed it.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "simd.h"

namespace rebar_cpu_quant {

// Bytes of one tile and block of codes: four chunks of low nibbles, then bits - 4 vectors of high bits
// (8-bit codes: the eight code vectors as they are).
template <int kBits>
constexpr int64_t kCodeBlockBytes = 32 * kBits;

// The 8 code vectors of one tile and block: w[k] byte 4 * row + j = the code of column 4k + j, so code
// vector k multiplies activation dword k (columns 4k..4k+3) broadcast to every row.
//
// Chunk c's low nibbles are columns 4c + j, its high nibbles columns 16 + 4c + j. For wider codes,
// the e = bits - 4 extra bits of code vector k sit in high-bit vector k / (8 / e), at bit
// e * (k % (8 / e)) of the byte: one vector of 8 single bits (5-bit codes) or two of 4 bit pairs (6).
// 8-bit codes are stored as the code vectors themselves: splitting them into
// nibbles would save nothing and cost the unpacking on every row of a compute-bound step.
template <int kBits>
inline void load_codes(const uint8_t* block, __m256i w[8]) {
  if constexpr (kBits == 8) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) w[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * k));
    return;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c));
    w[c] = _mm256_and_si256(raw, low4);
    w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
  }
  if constexpr (kBits > 4 && kBits < 8) {
    constexpr int kExtra = kBits - 4, kPerVector = 8 / kExtra;
    const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << kExtra) - 1) << 4));
    __m256i high[kExtra];
    for (int v = 0; v < kExtra; ++v) high[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * v));
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      // Move the code's extra bits to bits 4.. of its byte. A 16-bit shift carries bits across the
      // byte boundary only into positions the mask clears (shift + extra bits <= 8).
      const int shift = kExtra * (k % kPerVector);
      const __m256i h = high[k / kPerVector];
      const __m256i moved = shift >= 4 ? _mm256_srli_epi16(h, shift - 4) : _mm256_slli_epi16(h, 4 - shift);
      w[k] = _mm256_or_si256(w[k], _mm256_and_si256(moved, mask));
    }
  }
}

// Sums of unsigned code x signed activation byte products, four per int32 lane, over up to four code
// vectors of kBits-bit codes (half a block).
template <int kBits>
struct HalfDot {
#if defined(REBAR_VNNI)
  __m256i acc = _mm256_setzero_si256();
  inline void add(__m256i codes, __m256i x) { acc = dpbusd(acc, codes, x); }
  inline __m256i total() const { return acc; }
#else
  // maddubs pair sums are at most 2 * (2^kBits - 1) * 127: four of them fit int16 up to 5-bit codes
  // (31496), so those widen once; 6-bit codes widen after every product; 8-bit ones would saturate
  // maddubs itself, so they are multiplied a nibble at a time (16 * high + low).
  static constexpr bool kInt16 = kBits <= 5;
  __m256i acc = _mm256_setzero_si256();
  inline void add(__m256i codes, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (kBits == 8) {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      const __m256i low = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(codes, low4), x), ones);
      const __m256i high = _mm256_madd_epi16(
          _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(codes, 4), low4), x), ones);
      acc = _mm256_add_epi32(acc, _mm256_add_epi32(low, _mm256_slli_epi32(high, 4)));
      return;
    }
    const __m256i pairs = _mm256_maddubs_epi16(codes, x);
    acc = kInt16 ? _mm256_add_epi16(acc, pairs) : _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
  }
  inline __m256i total() const { return kInt16 ? _mm256_madd_epi16(acc, _mm256_set1_epi16(1)) : acc; }
#endif
};

// The whole block's dot products (int32 per row lane).
template <int kBits>
inline __m256i block_total(const HalfDot<kBits>& lo, const HalfDot<kBits>& hi) {
#if !defined(REBAR_VNNI)
  if constexpr (kBits == 4) {  // eight products of 4-bit codes fit int16 (30480): widen once
    return _mm256_madd_epi16(_mm256_add_epi16(lo.acc, hi.acc), _mm256_set1_epi16(1));
  }
#endif
  return _mm256_add_epi32(lo.total(), hi.total());
}

// Code vectors w[0..8) against R activation rows' block x[r] (32 int8 each): columns 0..15 into lo,
// 16..31 into hi.
template <int kBits, int R>
inline void block_dots(const __m256i w[8], const int8_t* const x[R], HalfDot<kBits> lo[R], HalfDot<kBits> hi[R]) {
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) lo[r].add(w[k], broadcast4(x[r] + 4 * k));
  }
#pragma GCC unroll 4
  for (int k = 4; k < 8; ++k) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) hi[r].add(w[k], broadcast4(x[r] + 4 * k));
  }
}

// acc + dot * (scale * dx): the affine kinds' block term (scale per row lane, dx the activation block's).
inline __m256 add_scaled_dot(__m256 acc, __m256i dot, __m256 scale, float dx) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(dx)), acc);
}

// kSym: acc + (dot - z sum) * (scale * dx), where z sum is the zero point times the block's sum of
// activation codes: the bracket is the exact integer dot product of (q - z) with the activations, at
// most 32 * 128 * 127 < 2^24, exact in float.
inline __m256 add_sym_dot(__m256 acc, __m256i dot, int32_t z_sum, __m256 scale, float dx) {
  return add_scaled_dot(acc, _mm256_sub_epi32(dot, _mm256_set1_epi32(z_sum)), scale, dx);
}

// kSuperAffine's sub-block scales and mins of one tile and super-block: 96 bytes of 6-bit values,
// as compact as GGUF's 12 bytes per row. Bytes 0..31 hold the scales' low 4 bits, byte
// 8 * b + r holding those of block b (low nibble) and block b + 4 (high nibble) of tile row r;
// bytes 32..63 the mins' likewise; bytes 64..95 their top 2 bits, at bit 0 (scale of block b), 2
// (scale of b + 4), 4 (min of b) and 6 (min of b + 4).
constexpr int64_t kKScaleBytes = 96;

// The 8 rows' values of block b (0..7) from a vector holding blocks b & ~3 .. (b & ~3) + 3.
inline __m256 block_lanes(__m256i four_blocks, int b) {
  const __m128i half = (b & 2) ? _mm256_extracti128_si256(four_blocks, 1) : _mm256_castsi256_si128(four_blocks);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((b & 1) ? _mm_srli_si128(half, 8) : half));
}

// A super-block's per-block scales d * sc[b] and mins dmin * m[b], for each of the tile's rows,
// from its 96 packed bytes (kept in registers: reading back bytes just stored stalls).
inline void k_block_scales(const uint8_t* packed, __m256 d, __m256 dmin, __m256 scales[8], __m256 mins[8]) {
  const __m256i low_scales = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
  const __m256i low_mins = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32));
  const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 64));
  const __m256i nibble = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(0x03);
  // Masking before each 16-bit shift keeps every value inside its byte.
  const auto top = [&](int shift) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, shift), two_bits), 4);
  };
  const auto join = [&](__m256i low, int shift, __m256i top_bits) {
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, shift), nibble), top_bits);
  };
  const __m256i sc[2] = {join(low_scales, 0, top(0)), join(low_scales, 4, top(2))};
  const __m256i m[2] = {join(low_mins, 0, top(4)), join(low_mins, 4, top(6))};
#pragma GCC unroll 8
  for (int b = 0; b < 8; ++b) {
    scales[b] = _mm256_mul_ps(d, block_lanes(sc[b / 4], b % 4));
    mins[b] = _mm256_mul_ps(dmin, block_lanes(m[b / 4], b % 4));
  }
}

// Eight signed bytes (one per row of a tile) widened.
inline __m256i i8x8_to_epi32(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// kSuperSym: acc + (sc_lo (lo - z sum_lo) + sc_hi (hi - z sum_hi)) * (d * dx), where z sum_h is the
// zero point times the half-block's sum of activation codes, so the bracket is the exact integer dot
// product of (q - z) with the activations: at most 2 * 16 * 32 * 127 * 128 < 2^24, exact in float.
inline __m256 add_sym16_dot(__m256 acc, __m256i lo, __m256i hi, __m256i sc_lo, __m256i sc_hi, int32_t z_sum_lo,
                            int32_t z_sum_hi, __m256 d, float dx) {
  const __m256i lo_dot = _mm256_mullo_epi32(_mm256_sub_epi32(lo, _mm256_set1_epi32(z_sum_lo)), sc_lo);
  const __m256i hi_dot = _mm256_mullo_epi32(_mm256_sub_epi32(hi, _mm256_set1_epi32(z_sum_hi)), sc_hi);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo_dot, hi_dot)), _mm256_mul_ps(d, _mm256_set1_ps(dx)),
                         acc);
}

}  // namespace rebar_cpu_quant
