// Small AVX2 helpers shared by the kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// Integer dot products of unsigned and signed bytes in one instruction (vpdpbusd), from AVX-512 VNNI
// (on 256-bit vectors, with AVX-512 VL) or AVX-VNNI; build.py passes the flags when the CPU has them.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define REBAR_VNNI 1
#endif

namespace rebar_cpu_quant {

#if defined(REBAR_VNNI)
// acc + the sums of four u8 x s8 products per int32 lane, exactly (no int16 saturation).
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

// The integer instruction set the kernels were built for (reported to Python).
inline const char* isa_name() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#else
  return "avx2";
#endif
}

// Eight scales of a tile, from float32 or float16 storage.
inline __m256 load_scales(const void* base, int64_t index, bool half) {
  if (half) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + index;
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  return _mm256_loadu_ps(static_cast<const float*>(base) + index);
}

// e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial (the Cephes
// coefficients), 2^n built in the exponent bits. Relative error ~2e-7; inputs below -87 give 0-ish
// (softmax and SiLU never need more).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so n * ln2_high is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// Lane k of the result is the sum of the eight int32 lanes of v[k]: turns eight per-row partial
// sums into one register holding one total per output row of the tile.
inline __m256i sum_lanes_of_8(const __m256i v[8]) {
  // hadd works within 128-bit halves: after two rounds, the low half of ab holds the low-half sums
  // of v0..v3 and its high half the high-half sums of v0..v3; cd likewise for v4..v7.
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  const __m256i low_halves = _mm256_permute2x128_si256(ab, cd, 0x20);
  const __m256i high_halves = _mm256_permute2x128_si256(ab, cd, 0x31);
  return _mm256_add_epi32(low_halves, high_halves);
}

// The float form of sum_lanes_of_8: lane k = the sum of the eight lanes of v[k].
inline __m256 sum_lanes_of_8_ps(const __m256 v[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Four int8 activations repeated in every 32-bit lane (the maddubs operand against int4 chunks).
inline __m256i broadcast4(const int8_t* x) {
  int32_t bits;
  std::memcpy(&bits, x, 4);
  return _mm256_set1_epi32(bits);
}

// Stores the first `count` lanes (a partial last tile writes only real output rows).
inline void store_lanes(float* dst, __m256 v, int64_t count) {
  if (count == 8) {
    _mm256_storeu_ps(dst, v);
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int64_t i = 0; i < count; ++i) dst[i] = lanes[i];
}

}  // namespace rebar_cpu_quant
