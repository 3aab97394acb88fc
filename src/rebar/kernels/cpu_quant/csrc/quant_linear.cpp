// y = x @ w.T for int4 (scale + offset per group) and int8 (scale per group) packed weights.
//
// For one tile of 8 output rows and one activation row:
//   y[o] = sum_g scale[o,g] * sum_{b in g} d_x[b] * sum_{c in b} q_w[o,c] * q_x[c]   (int4, int8)
//        + sum_g offset[o,g] * sum_{c in g} x[c]                                     (int4 only)
// The innermost sum is exact int32 arithmetic; everything after it is float32.
#include <immintrin.h>

#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace rebar_cpu_quant {
namespace {

// 4-bit codes: 16 bytes per row and block, low nibbles = columns 0..15, high = columns 16..31.
struct Int4Format {
  static constexpr int64_t kBlockBytes = 16;
  static constexpr bool kHasOffsets = true;

  // Exact dot products of one activation block with the same block of the tile's 8 rows.
  static __m256i block_dots(const uint8_t* codes, __m256i xq) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums[kTileRows];
    for (int k = 0; k < kTileRows; ++k) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + kBlockBytes * k));
      const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_nibbles);
      // maddubs: unsigned weights (0..15) x signed activations, pairs summed into int16 (|.| <= 3810,
      // no saturation); madd with ones widens the pairs to int32.
      sums[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones);
    }
    return sum_lanes_of_8(sums);
  }
};

// 8-bit signed codes: 32 bytes per row and block.
struct Int8Format {
  static constexpr int64_t kBlockBytes = 32;
  static constexpr bool kHasOffsets = false;

  static __m256i block_dots(const uint8_t* codes, __m256i xq) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums[kTileRows];
    for (int k = 0; k < kTileRows; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + kBlockBytes * k));
      // maddubs needs one unsigned operand: use |w| and move w's sign onto the activations.
      // |-128| = 128 still fits as unsigned, and activations are within [-127, 127], so pair
      // sums stay within 2 * 128 * 127 < 32768.
      const __m256i x_signed = _mm256_sign_epi8(xq, w);
      sums[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), x_signed), ones);
    }
    return sum_lanes_of_8(sums);
  }
};

// One tile (8 output rows) against one quantized activation row.
template <typename Format, bool kHalfScales>
__m256 tile_dot(const PackedWeights& w, int64_t tile, const int8_t* xq, const float* xd,
                const float* x_group_sums) {
  const int64_t num_groups = w.num_blocks / w.blocks_per_group;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + tile * w.num_blocks * kTileRows * Format::kBlockBytes;
  const int64_t scale_index = tile * num_groups * kTileRows;
  __m256 acc = _mm256_setzero_ps();
  __m256 offset_acc = _mm256_setzero_ps();  // a second chain, so the two FMAs per group overlap
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256 group_acc = _mm256_setzero_ps();
    for (int64_t b = g * w.blocks_per_group; b < (g + 1) * w.blocks_per_group; ++b) {
      const __m256i x_block = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
      const __m256i dots = Format::block_dots(codes + b * kTileRows * Format::kBlockBytes, x_block);
      group_acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(xd[b]), group_acc);
    }
    const int64_t index = scale_index + g * kTileRows;
    acc = _mm256_fmadd_ps(group_acc, load_scales(w.scales, index, kHalfScales), acc);
    if constexpr (Format::kHasOffsets) {
      offset_acc = _mm256_fmadd_ps(load_scales(w.offsets, index, kHalfScales),
                                   _mm256_set1_ps(x_group_sums[g]), offset_acc);
    }
  }
  return _mm256_add_ps(acc, offset_acc);
}

template <typename Format, bool kHalfScales>
void linear_tiles(const QuantizedRows& x, const PackedWeights& w, float* y, int num_threads) {
  const int64_t row_values = x.num_blocks * kBlock;
  const int64_t num_groups = w.num_blocks / w.blocks_per_group;
  // Each thread takes a contiguous range of tiles: one sequential weight stream per core. The
  // activation rows are looped inside, so a tile's weights are read from memory once and then
  // reused from L1 for every row.
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t tile = 0; tile < w.num_tiles; ++tile) {
    const int64_t first_out = tile * kTileRows;
    const int64_t count = std::min<int64_t>(kTileRows, w.out_features - first_out);
    for (int64_t r = 0; r < x.rows; ++r) {
      const float* sums = x.group_sums ? x.group_sums + r * num_groups : nullptr;
      const __m256 out = tile_dot<Format, kHalfScales>(w, tile, x.q + r * row_values, x.d + r * x.num_blocks, sums);
      store_lanes(y + r * w.out_features + first_out, out, count);
    }
  }
}

}  // namespace

void int4_linear(const QuantizedRows& x, const PackedWeights& w, float* y, int num_threads) {
  if (w.half_scales) {
    linear_tiles<Int4Format, true>(x, w, y, num_threads);
  } else {
    linear_tiles<Int4Format, false>(x, w, y, num_threads);
  }
}

void int8_linear(const QuantizedRows& x, const PackedWeights& w, float* y, int num_threads) {
  if (w.half_scales) {
    linear_tiles<Int8Format, true>(x, w, y, num_threads);
  } else {
    linear_tiles<Int8Format, false>(x, w, y, num_threads);
  }
}

}  // namespace rebar_cpu_quant
