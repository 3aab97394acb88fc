// y = x @ w.T for a handful to a few dozen activation rows on AVX-512 builds: a verification step's
// rows, a batch of decoding streams, the output head of a step with drafts. Every weight kind.
//
// The small-batch kernel (quant_linear.cpp) loads one tile's code vector and multiplies it by one
// row's activation dword at a time: a load or a broadcast for every dot-product instruction, so past
// a few rows the loads, not the products, set its pace. Here two pairs of neighbouring tiles (32
// outputs, two 512-bit registers of pair_dots.h's layout) go against six rows together (four for
// Q6_K, whose two half-blocks keep sums of their own): each
// code vector loaded serves every row, and each activation dword broadcast serves both pairs.
//
// The arithmetic of each output is the small-batch kernel's: the block's exact integer dot product
// (summed here in one chain rather than two halves: integers, so the same), then the same float steps
// in the same order. A row gets the same bits whichever kernel computed it (tested for every kind and
// width, tests/kernels/test_cpu_quant_kinds.py).
#include <immintrin.h>

#include <cstdint>

#include "block_dots.h"
#include "kernels.h"
#include "pair_dots.h"
#include "simd.h"

namespace rebar_cpu_quant {

#if defined(REBAR_PAIRED_TILES)
namespace {

// Pairs of tiles side by side (registers: kPairs * rows integer sums and as many float accumulators,
// kPairs code vectors and one broadcast: 31 of AVX-512's 32 at six rows). On Gemma 3's output head
// (262,144 x 640 Q8_0) at 16 rows: 2 pairs x 6 rows 0.89 ms a row, 2 x 4 0.92, 3 x 4 0.91, 1 x 8
// 0.94, against 1.25 for the small-batch kernel in the same runs (docs/kernels.md).
constexpr int kPairs = 2;
constexpr int kTilesAtOnce = 2 * kPairs;

inline __m512i load_pair(const uint8_t* first, const uint8_t* second) {
  return join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first)),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second)));
}

// Code vectors c and c + 4 (block_dots.h's layout) of one block of a pair of tiles, whose block bytes
// start at `first` and `second`; `high` holds the pair's high-bit vectors (5-bit codes: one, whose
// bit k is code vector k's fifth bit; 6-bit codes: two, with bit pair k % 4 of vector k / 4).
template <int kBits>
inline void pair_code_vectors(const uint8_t* first, const uint8_t* second, int c, const __m512i high[2],
                              __m512i& low_cols, __m512i& high_cols) {
  if constexpr (kBits == 8) {
    low_cols = load_pair(first + 32 * c, second + 32 * c);
    high_cols = load_pair(first + 32 * (c + 4), second + 32 * (c + 4));
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i raw = load_pair(first + 32 * c, second + 32 * c);
  low_cols = _mm512_and_si512(raw, low4);
  high_cols = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
  // Each code's extra bits move to bits 4.. of its byte (a 16-bit shift carries bits across bytes
  // only into positions the mask clears), as load_codes does.
  if constexpr (kBits == 5) {
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    low_cols = _mm512_or_si512(low_cols, _mm512_and_si512(_mm512_slli_epi16(high[0], 4 - c), bit4));
    high_cols = _mm512_or_si512(high_cols, _mm512_and_si512(_mm512_srli_epi16(high[0], c), bit4));
  }
  if constexpr (kBits == 6) {
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    const int shift = 2 * c;  // the same bit pair of vectors 0 and 1
    const auto moved = [&](__m512i h) { return shift >= 4 ? _mm512_srli_epi16(h, shift - 4) : _mm512_slli_epi16(h, 4 - shift); };
    low_cols = _mm512_or_si512(low_cols, _mm512_and_si512(moved(high[0]), bits45));
    high_cols = _mm512_or_si512(high_cols, _mm512_and_si512(moved(high[1]), bits45));
  }
}

// kSuperSym keeps each block's two halves apart (their sub-block scales differ).
template <WeightKind kKind>
constexpr bool kHalves = kKind == WeightKind::kSuperSym;

// Rows at once per kind: the halves' sums take twice the registers.
template <WeightKind kKind>
constexpr int kRowsOf = kHalves<kKind> ? 4 : 6;

// One group's per-block scale vectors of a pair (K-quants: from the packed sub-block scales).
struct PairGroupScales {
  __m512 scale[8], min[8];    // kSuperAffine's d * sc and dmin * m per block
  __m512i sub_lo[8], sub_hi[8];  // kSuperSym's half-block scales per block
};

template <WeightKind kKind>
inline void pair_group_scales(const PackedWeights& w, int64_t first_tile, int64_t g, int64_t num_groups,
                              PairGroupScales& out) {
  const int64_t at[2] = {(first_tile * num_groups + g) * kTileRows, ((first_tile + 1) * num_groups + g) * kTileRows};
  if constexpr (kKind == WeightKind::kSuperAffine) {
    __m256 scales[2][8], mins[2][8];
    for (int t = 0; t < 2; ++t) {
      k_block_scales(w.sub_scales + ((first_tile + t) * num_groups + g) * kKScaleBytes, load_scales(w.scales, at[t], true),
                     load_scales(w.offsets, at[t], true), scales[t], mins[t]);
    }
    for (int i = 0; i < 8; ++i) {
      out.scale[i] = join(scales[0][i], scales[1][i]);
      out.min[i] = join(mins[0][i], mins[1][i]);
    }
  } else {  // kSuperSym: int8 [16, 8] per tile and super-block
    const uint8_t* subs[2] = {w.sub_scales + at[0] * w.blocks_per_group * 2, w.sub_scales + at[1] * w.blocks_per_group * 2};
    for (int64_t i = 0; i < w.blocks_per_group; ++i) {
      out.sub_lo[i] = join(i8x8_to_epi32(subs[0] + 2 * i * kTileRows), i8x8_to_epi32(subs[1] + 2 * i * kTileRows));
      out.sub_hi[i] = join(i8x8_to_epi32(subs[0] + (2 * i + 1) * kTileRows), i8x8_to_epi32(subs[1] + (2 * i + 1) * kTileRows));
    }
  }
}

// kTilesAtOnce tiles from `tile` against R rows from `row`.
template <WeightKind kKind, int kBits, int R, bool kHalf>
void tiles_times_rows(const QuantizedRows& x, const PackedWeights& w, int64_t tile, int64_t row, float* y) {
  constexpr int64_t kBytes = kCodeBlockBytes<kBits>;
  constexpr bool kSuper = kKind == WeightKind::kSuperAffine || kKind == WeightKind::kSuperSym;
  const int64_t num_groups = w.num_blocks / w.blocks_per_group, per_group = w.blocks_per_group;
  const uint8_t* codes[kTilesAtOnce];
  for (int i = 0; i < kTilesAtOnce; ++i) codes[i] = w.codes + (tile + i) * w.num_blocks * kBytes;
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q + (row + r) * x.num_blocks * kBlock;
  const auto pair_scales = [&](const void* base, int p, int64_t g) {
    return join(load_scales(base, ((tile + 2 * p) * num_groups + g) * kTileRows, kHalf || kSuper),
                load_scales(base, ((tile + 2 * p + 1) * num_groups + g) * kTileRows, kHalf || kSuper));
  };

  __m512 acc[kPairs][R];
  for (int p = 0; p < kPairs; ++p)
    for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 scale[kPairs];  // kSym/kAffine: the group's scale; kSuperSym: d
    PairGroupScales group[kSuper ? kPairs : 1];
    for (int p = 0; p < kPairs; ++p) {
      if constexpr (kKind != WeightKind::kSuperAffine) scale[p] = pair_scales(w.scales, p, g);
      if constexpr (kSuper) pair_group_scales<kKind>(w, tile + 2 * p, g, num_groups, group[p]);
    }
    for (int64_t i = 0; i < per_group; ++i) {
      const int64_t b = g * per_group + i;
      __m512i high[kPairs][2] = {};
      for (int p = 0; p < kPairs; ++p) {
        for (int v = 0; v < kBits - 4 && kBits < 8; ++v) {
          high[p][v] = load_pair(codes[2 * p] + b * kBytes + 128 + 32 * v, codes[2 * p + 1] + b * kBytes + 128 + 32 * v);
        }
      }
      __m512i dot[kPairs][R], dot_hi[kPairs][kHalves<kKind> ? R : 1];
      for (int p = 0; p < kPairs; ++p) {
        for (int r = 0; r < R; ++r) dot[p][r] = _mm512_setzero_si512();
        if constexpr (kHalves<kKind>) {
          for (int r = 0; r < R; ++r) dot_hi[p][r] = _mm512_setzero_si512();
        }
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m512i low_cols[kPairs], high_cols[kPairs];
        for (int p = 0; p < kPairs; ++p) {
          pair_code_vectors<kBits>(codes[2 * p] + b * kBytes, codes[2 * p + 1] + b * kBytes, c, high[p], low_cols[p],
                                   high_cols[p]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* x_block = xq[r] + b * kBlock;
          const __m512i low_x = broadcast4_512(x_block + 4 * c);
          for (int p = 0; p < kPairs; ++p) dot[p][r] = _mm512_dpbusd_epi32(dot[p][r], low_cols[p], low_x);
          const __m512i high_x = broadcast4_512(x_block + 16 + 4 * c);
          for (int p = 0; p < kPairs; ++p) {
            __m512i& sum = kHalves<kKind> ? dot_hi[p][kHalves<kKind> ? r : 0] : dot[p][r];
            sum = _mm512_dpbusd_epi32(sum, high_cols[p], high_x);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row + r) * x.num_blocks + b;
        const __m512 dx = _mm512_set1_ps(x.d[at]);
        const int32_t* sums = x.half_sums + 2 * at;
        for (int p = 0; p < kPairs; ++p) {
          if constexpr (kKind == WeightKind::kSuperSym) {  // add_sym16_dot
            const __m512i lo = _mm512_mullo_epi32(_mm512_sub_epi32(dot[p][r], _mm512_set1_epi32(w.zero_point * sums[0])),
                                                  group[p].sub_lo[i]);
            const __m512i hi = _mm512_mullo_epi32(
                _mm512_sub_epi32(dot_hi[p][kHalves<kKind> ? r : 0], _mm512_set1_epi32(w.zero_point * sums[1])),
                group[p].sub_hi[i]);
            acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(scale[p], dx), acc[p][r]);
          } else if constexpr (kKind == WeightKind::kSuperAffine) {  // add_scaled_dot, then the min term
            acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[p][r]), _mm512_mul_ps(group[p].scale[i], dx), acc[p][r]);
            acc[p][r] = _mm512_fnmadd_ps(group[p].min[i], _mm512_set1_ps(x.group_sums[at]), acc[p][r]);
          } else {  // add_sym_dot / add_scaled_dot
            __m512i block_dot = dot[p][r];
            if constexpr (kKind == WeightKind::kSym) {
              block_dot = _mm512_sub_epi32(block_dot, _mm512_set1_epi32(w.zero_point * (sums[0] + sums[1])));
            }
            acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot), _mm512_mul_ps(scale[p], dx), acc[p][r]);
          }
        }
      }
    }
  }
  if constexpr (kKind == WeightKind::kAffine) {
    for (int64_t g = 0; g < num_groups; ++g) {
      for (int p = 0; p < kPairs; ++p) {
        const __m512 offset = pair_scales(w.offsets, p, g);
        for (int r = 0; r < R; ++r) pair_offset<1>(offset, x, row + r, g, num_groups, &acc[p][r]);
      }
    }
  }
  for (int p = 0; p < kPairs; ++p) store_pair<R>(w, tile + 2 * p, row, acc[p], y);
}

// The last `count` (< kRowsOf<kKind>) rows from `row`.
template <WeightKind kKind, int kBits, bool kHalf, int R = kRowsOf<kKind> - 1>
void ragged_rows(const QuantizedRows& x, const PackedWeights& w, int64_t tile, int64_t row, int64_t count, float* y) {
  if constexpr (R >= 1) {
    if (count == R) return tiles_times_rows<kKind, kBits, R, kHalf>(x, w, tile, row, y);
    ragged_rows<kKind, kBits, kHalf, R - 1>(x, w, tile, row, count, y);
  }
}

template <WeightKind kKind, int kBits, bool kHalf>
int64_t range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t begin, int64_t end) {
  int64_t tile = begin;
  for (; tile + kTilesAtOnce <= end; tile += kTilesAtOnce) {
    int64_t row = 0;
    for (; row + kRowsOf<kKind> <= x.rows; row += kRowsOf<kKind>) {
      tiles_times_rows<kKind, kBits, kRowsOf<kKind>, kHalf>(x, w, tile, row, y);
    }
    ragged_rows<kKind, kBits, kHalf>(x, w, tile, row, x.rows - row, y);
  }
  return tile;
}

template <WeightKind kKind, int kBits>
int64_t scaled_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t begin, int64_t end) {
  return w.half_scales ? range<kKind, kBits, true>(x, w, y, begin, end) : range<kKind, kBits, false>(x, w, y, begin, end);
}

}  // namespace
#endif

int64_t pair_rows_tiles(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin, int64_t tile_end) {
#if defined(REBAR_PAIRED_TILES)
  if (x.rows < kPairRowsMinRows) return tile_begin;
  const int64_t b = tile_begin, e = tile_end;
  switch (w.kind) {
    case WeightKind::kSym:
      if (w.code_bits == 8) return scaled_range<WeightKind::kSym, 8>(x, w, y, b, e);
      if (w.code_bits == 5) return scaled_range<WeightKind::kSym, 5>(x, w, y, b, e);
      return scaled_range<WeightKind::kSym, 4>(x, w, y, b, e);
    case WeightKind::kAffine:
      if (w.code_bits == 5) return scaled_range<WeightKind::kAffine, 5>(x, w, y, b, e);
      return scaled_range<WeightKind::kAffine, 4>(x, w, y, b, e);
    case WeightKind::kSuperAffine:
      if (w.code_bits == 5) return range<WeightKind::kSuperAffine, 5, true>(x, w, y, b, e);
      return range<WeightKind::kSuperAffine, 4, true>(x, w, y, b, e);
    case WeightKind::kSuperSym:
      return range<WeightKind::kSuperSym, 6, true>(x, w, y, b, e);
  }
#else
  (void)x;
  (void)w;
  (void)y;
  (void)tile_end;
#endif
  return tile_begin;
}

}  // namespace rebar_cpu_quant
