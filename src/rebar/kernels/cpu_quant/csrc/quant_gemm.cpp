// y = x @ w.T for int4 weights and many activation rows (prefill): the compute-bound case.
//
// Same arithmetic as the int4 kernel in quant_linear.cpp (exact int32 block dots of int8 activations
// with 4-bit codes, then float scales and offsets, in the same order), so a row's result does not
// depend on which of the two computed it. What differs is the schedule:
//   - a tile's codes are expanded once to one byte per code, into a thread-local buffer that stays
//     in L1, so each further row pays one load per 32 codes instead of a load, two masks and a shift;
//   - rows go through a tile two at a time with every weight vector shared by both, which keeps the
//     live registers (two int16 sums, two float accumulators) well below AVX2's 16;
//   - rows are taken in panels whose activations fit in L2, and each panel sweeps the thread's tiles.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace rebar_cpu_quant {
namespace {

// Activation bytes per row panel: the panel is re-read once per tile, from L2 (512 KiB per core
// here, shared with the expanded tile and the output rows).
constexpr int64_t kPanelBytes = 256 * 1024;

// A tile expanded for the row loop: for block b, vector k holds columns 4k..4k+3 of the 8 rows
// (byte 4 * row + j = code of column 4k + j) as bytes 0..15; the scales as float32, repeated for
// every block of a group (so the row loop has no group loop), and the offsets per group.
struct ExpandedTile {
  std::vector<__m256i> codes;        // [num_blocks * 8]
  std::vector<__m256> block_scales;  // [num_blocks]
  std::vector<__m256> offsets;       // [num_groups]
};

void expand_tile(const PackedWeights& w, int64_t tile, ExpandedTile& out) {
  const int64_t num_groups = w.num_blocks / w.blocks_per_group;
  out.codes.resize(w.num_blocks * 8);
  out.block_scales.resize(w.num_blocks);
  out.offsets.resize(num_groups);
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + tile * w.num_blocks * 4 * 32;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.num_blocks; ++b) {
    for (int c = 0; c < 4; ++c) {  // the packed layout (kernels.h): chunk c = columns 4c.. and 16 + 4c..
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (b * 4 + c) * 32));
      out.codes[b * 8 + c] = _mm256_and_si256(raw, low_nibbles);
      out.codes[b * 8 + 4 + c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);
    }
  }
  const int64_t scale_base = tile * num_groups * kTileRows;
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m256 scale = load_scales(w.scales, scale_base + g * kTileRows, w.half_scales);
    std::fill_n(&out.block_scales[g * w.blocks_per_group], w.blocks_per_group, scale);
    out.offsets[g] = load_scales(w.offsets, scale_base + g * kTileRows, w.half_scales);
  }
}

// R rows (1 or 2) starting at `row` against one expanded tile; writes their 8 outputs.
template <int R>
void rows_times_tile(const QuantizedRows& x, const PackedWeights& w, const ExpandedTile& tile, int64_t tile_index,
                     int64_t row, float* y) {
  const int64_t num_groups = w.num_blocks / w.blocks_per_group;
  const int8_t* xq[R];
  const float* xd[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q + (row + r) * x.num_blocks * kBlock;
    xd[r] = x.d + (row + r) * x.num_blocks;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i* codes = tile.codes.data();
  for (int64_t b = 0; b < w.num_blocks; ++b) {
    // maddubs: unsigned codes (0..15) x signed activations (|q| <= 127) summed in pairs; each int16
    // lane gathers 8 pairs, at most 8 * 2 * 15 * 127 = 30480: within int16.
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_maddubs_epi16(codes[b * 8], broadcast4(xq[r] + b * kBlock));
#pragma GCC unroll 8
    for (int k = 1; k < 8; ++k) {
      const __m256i wk = codes[b * 8 + k];
      for (int r = 0; r < R; ++r) {
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(wk, broadcast4(xq[r] + b * kBlock + 4 * k)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
      acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(tile.block_scales[b], _mm256_set1_ps(xd[r][b])), acc[r]);
    }
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(tile.offsets[g], _mm256_set1_ps(x.group_sums[(row + r) * num_groups + g]), acc[r]);
    }
  }
  const int64_t first_out = tile_index * kTileRows;
  const int64_t count = std::min<int64_t>(kTileRows, w.out_features - first_out);
  for (int r = 0; r < R; ++r) store_lanes(y + (row + r) * w.out_features + first_out, acc[r], count);
}

}  // namespace

void int4_gemm_tile_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin,
                          int64_t tile_end) {
  thread_local ExpandedTile tile;
  const int64_t panel_rows = std::max<int64_t>(2, kPanelBytes / (x.num_blocks * kBlock));
  for (int64_t panel = 0; panel < x.rows; panel += panel_rows) {
    const int64_t panel_end = std::min(x.rows, panel + panel_rows);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      expand_tile(w, t, tile);
      int64_t row = panel;
      for (; row + 2 <= panel_end; row += 2) rows_times_tile<2>(x, w, tile, t, row, y);
      if (row < panel_end) rows_times_tile<1>(x, w, tile, t, row, y);
    }
  }
}

}  // namespace rebar_cpu_quant
