// y = x @ w.T for many activation rows (prefill): the compute-bound case.
//
// Same arithmetic as the small-batch kernel in quant_linear.cpp (the functions of block_dots.h, in
// the same order), so a row's result does not depend on which of the two computed it. What differs
// is the schedule:
//   - a tile's codes are expanded once to one byte per code (high bits merged), and its scales to
//     one float vector per block, into a thread-local buffer that stays in L1, so each further row
//     pays one load per four columns and no unpacking;
//   - rows go through a tile a few at a time with every weight vector shared by all of them;
//   - rows are taken in panels whose activations fit in L2, and each panel sweeps the thread's tiles;
//   - with AVX-512, two tiles go side by side in one 512-bit register (pair_dots.h): each lane does
//     exactly what it does in a 256-bit one, with half the broadcasts and scale steps per product.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_dots.h"
#include "kernels.h"
#include "pair_dots.h"
#include "simd.h"

namespace rebar_cpu_quant {
namespace {

// Activation bytes per row panel: the panel is re-read once per tile, from L2 (512 KiB per core
// here, shared with the expanded tile and the output rows).
constexpr int64_t kPanelBytes = 256 * 1024;

// Rows sharing each expanded weight vector. With VNNI each row keeps two chains of dot-product
// instructions (several cycles of latency each) and AVX-512's 32 registers hold four rows' worth;
// AVX2's int16 sums are one-cycle adds and 16 registers fit two rows.
#if defined(REBAR_VNNI)
constexpr int kRowsAtOnce = 4;
#else
constexpr int kRowsAtOnce = 2;
#endif

// One tile expanded for the row loop.
struct ExpandedTile {
  std::vector<__m256i> codes;        // [num_blocks * 8]: load_codes' vectors
  std::vector<__m256> block_scales;  // [num_blocks]: kSym/kAffine the group's scale, kSuperAffine d sc, kSuperSym d
  std::vector<__m256> block_mins;    // [num_blocks]: kSuperAffine dmin m
  std::vector<__m256> offsets;       // [num_groups]: kAffine
  std::vector<__m256i> sub_scales;   // [num_blocks * 2]: kSuperSym sc of each half-block
};

template <WeightKind kKind, int kBits>
void expand_tile(const PackedWeights& w, int64_t tile, ExpandedTile& out) {
  constexpr int64_t kBytes = kCodeBlockBytes<kBits>;
  const int64_t num_groups = w.num_blocks / w.blocks_per_group, per_group = w.blocks_per_group;
  out.codes.resize(w.num_blocks * 8);
  out.block_scales.resize(w.num_blocks);
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + tile * w.num_blocks * kBytes;
  for (int64_t b = 0; b < w.num_blocks; ++b) load_codes<kBits>(codes + b * kBytes, &out.codes[b * 8]);

  const int64_t scale_base = tile * num_groups * kTileRows;
  if constexpr (kKind == WeightKind::kAffine) out.offsets.resize(num_groups);
  if constexpr (kKind == WeightKind::kSuperAffine) out.block_mins.resize(w.num_blocks);
  if constexpr (kKind == WeightKind::kSuperSym) out.sub_scales.resize(w.num_blocks * 2);
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t at = scale_base + g * kTileRows;
    const __m256 scale = load_scales(w.scales, at, w.half_scales);
    if constexpr (kKind == WeightKind::kSuperAffine) {  // per_group is 8
      k_block_scales(w.sub_scales + (tile * num_groups + g) * kKScaleBytes, scale, load_scales(w.offsets, at, true),
                     &out.block_scales[g * 8], &out.block_mins[g * 8]);
    }
    for (int64_t i = 0; i < per_group; ++i) {
      const int64_t b = g * per_group + i;
      if constexpr (kKind != WeightKind::kSuperAffine) out.block_scales[b] = scale;
      if constexpr (kKind == WeightKind::kSuperSym) {
        const uint8_t* subs = w.sub_scales + at * per_group * 2;
        out.sub_scales[2 * b] = i8x8_to_epi32(subs + 2 * i * kTileRows);
        out.sub_scales[2 * b + 1] = i8x8_to_epi32(subs + (2 * i + 1) * kTileRows);
      }
    }
    if constexpr (kKind == WeightKind::kAffine) out.offsets[g] = load_scales(w.offsets, at, w.half_scales);
  }
}

// R rows starting at `row` against one expanded tile; writes their 8 outputs.
template <WeightKind kKind, int kBits, int R>
void rows_times_tile(const QuantizedRows& x, const PackedWeights& w, const ExpandedTile& tile, int64_t tile_index,
                     int64_t row, float* y) {
  const int64_t num_groups = w.num_blocks / w.blocks_per_group;
  const int8_t* xq[R];
  const float* xd[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q + (row + r) * x.num_blocks * kBlock;
    xd[r] = x.d + (row + r) * x.num_blocks;
  }
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.num_blocks; ++b) {
    const int8_t* x_block[R];
    for (int r = 0; r < R; ++r) x_block[r] = xq[r] + b * kBlock;
    HalfDot<kBits> lo[R], hi[R];
    block_dots<kBits, R>(&tile.codes[b * 8], x_block, lo, hi);
    for (int r = 0; r < R; ++r) {
      const int32_t* sums = x.half_sums + ((row + r) * x.num_blocks + b) * 2;
      if constexpr (kKind == WeightKind::kSuperSym) {
        acc[r] = add_sym16_dot(acc[r], lo[r].total(), hi[r].total(), tile.sub_scales[2 * b], tile.sub_scales[2 * b + 1],
                               w.zero_point * sums[0], w.zero_point * sums[1], tile.block_scales[b], xd[r][b]);
      } else if constexpr (kKind == WeightKind::kSym) {
        acc[r] = add_sym_dot(acc[r], block_total(lo[r], hi[r]), w.zero_point * (sums[0] + sums[1]),
                             tile.block_scales[b], xd[r][b]);
      } else {
        acc[r] = add_scaled_dot(acc[r], block_total(lo[r], hi[r]), tile.block_scales[b], xd[r][b]);
      }
      if constexpr (kKind == WeightKind::kSuperAffine) {
        acc[r] = _mm256_fnmadd_ps(tile.block_mins[b], _mm256_set1_ps(x.group_sums[(row + r) * x.num_blocks + b]),
                                  acc[r]);
      }
    }
  }
  if constexpr (kKind == WeightKind::kAffine) {
    for (int64_t g = 0; g < num_groups; ++g) {
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(tile.offsets[g], _mm256_set1_ps(x.group_sums[(row + r) * num_groups + g]), acc[r]);
      }
    }
  }
  const int64_t first_out = tile_index * kTileRows;
  const int64_t count = std::min<int64_t>(kTileRows, w.out_features - first_out);
  for (int r = 0; r < R; ++r) store_lanes(y + (row + r) * w.out_features + first_out, acc[r], count);
}

#if defined(REBAR_PAIRED_TILES)
// Rows sharing each expanded pair vector: as many as the 256-bit schedule's (more measured no faster).
constexpr int kPairRows = 4;

// Two expanded tiles side by side (pair_dots.h).
struct ExpandedPair {
  std::vector<__m512i> codes;
  std::vector<__m512> block_scales, block_mins, offsets;
  std::vector<__m512i> sub_scales;
};

template <typename Wide, typename Narrow>
void join_all(const std::vector<Narrow>& low, const std::vector<Narrow>& high, std::vector<Wide>& out) {
  out.resize(low.size());
  for (size_t i = 0; i < low.size(); ++i) out[i] = join(low[i], high[i]);
}

inline void join_tiles(const ExpandedTile& first, const ExpandedTile& second, ExpandedPair& out) {
  join_all(first.codes, second.codes, out.codes);
  join_all(first.block_scales, second.block_scales, out.block_scales);
  join_all(first.block_mins, second.block_mins, out.block_mins);
  join_all(first.offsets, second.offsets, out.offsets);
  join_all(first.sub_scales, second.sub_scales, out.sub_scales);
}

// rows_times_tile on a pair.
template <WeightKind kKind, int R>
void rows_times_pair(const QuantizedRows& x, const PackedWeights& w, const ExpandedPair& pair, int64_t tile_index,
                     int64_t row, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  PairBlockScales scales{};
  for (int64_t b = 0; b < w.num_blocks; ++b) {
    scales.scale = pair.block_scales[b];
    if constexpr (kKind == WeightKind::kSuperAffine) scales.min = pair.block_mins[b];
    if constexpr (kKind == WeightKind::kSuperSym) {
      scales.sub_lo = pair.sub_scales[2 * b];
      scales.sub_hi = pair.sub_scales[2 * b + 1];
    }
    pair_block<kKind, R>(&pair.codes[b * 8], scales, x, row, b, w.zero_point, acc);
  }
  if constexpr (kKind == WeightKind::kAffine) {
    const int64_t num_groups = w.num_blocks / w.blocks_per_group;
    for (int64_t g = 0; g < num_groups; ++g) pair_offset<R>(pair.offsets[g], x, row, g, num_groups, acc);
  }
  store_pair<R>(w, tile_index, row, acc, y);
}

// Rows [row, row_end) against a pair, kPairRows at a time.
template <WeightKind kKind>
void pair_rows(const QuantizedRows& x, const PackedWeights& w, const ExpandedPair& pair, int64_t tile_index,
               int64_t row, int64_t row_end, float* y) {
  for (; row + kPairRows <= row_end; row += kPairRows) rows_times_pair<kKind, kPairRows>(x, w, pair, tile_index, row, y);
  switch (row_end - row) {
    case 3: rows_times_pair<kKind, 3>(x, w, pair, tile_index, row, y); break;
    case 2: rows_times_pair<kKind, 2>(x, w, pair, tile_index, row, y); break;
    case 1: rows_times_pair<kKind, 1>(x, w, pair, tile_index, row, y); break;
    default: break;
  }
}
#endif

template <WeightKind kKind, int kBits>
void gemm_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin, int64_t tile_end) {
  thread_local ExpandedTile tile;
#if defined(REBAR_PAIRED_TILES)
  thread_local ExpandedTile second;
  thread_local ExpandedPair pair;
#endif
  const int64_t panel_rows = std::max<int64_t>(kRowsAtOnce, kPanelBytes / (x.num_blocks * kBlock));
  for (int64_t panel = 0; panel < x.rows; panel += panel_rows) {
    const int64_t panel_end = std::min(x.rows, panel + panel_rows);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
#if defined(REBAR_PAIRED_TILES)
      if (t + 1 < tile_end) {
        expand_tile<kKind, kBits>(w, t, tile);
        expand_tile<kKind, kBits>(w, t + 1, second);
        join_tiles(tile, second, pair);
        pair_rows<kKind>(x, w, pair, t, panel, panel_end, y);
        ++t;
        continue;
      }
#endif
      expand_tile<kKind, kBits>(w, t, tile);
      int64_t row = panel;
      for (; row + kRowsAtOnce <= panel_end; row += kRowsAtOnce) {
        rows_times_tile<kKind, kBits, kRowsAtOnce>(x, w, tile, t, row, y);
      }
      switch (panel_end - row) {  // the ragged end
        case 3: if constexpr (kRowsAtOnce > 3) rows_times_tile<kKind, kBits, 3>(x, w, tile, t, row, y); break;
        case 2: if constexpr (kRowsAtOnce > 2) rows_times_tile<kKind, kBits, 2>(x, w, tile, t, row, y); break;
        case 1: rows_times_tile<kKind, kBits, 1>(x, w, tile, t, row, y); break;
        default: break;
      }
    }
  }
}

}  // namespace

void gemm_tile_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin, int64_t tile_end) {
  const int64_t b = tile_begin, e = tile_end;
  switch (w.kind) {
    case WeightKind::kSym:
      if (w.code_bits == 8) return gemm_range<WeightKind::kSym, 8>(x, w, y, b, e);
      if (w.code_bits == 5) return gemm_range<WeightKind::kSym, 5>(x, w, y, b, e);
      return gemm_range<WeightKind::kSym, 4>(x, w, y, b, e);
    case WeightKind::kAffine:
      if (w.code_bits == 5) return gemm_range<WeightKind::kAffine, 5>(x, w, y, b, e);
      return gemm_range<WeightKind::kAffine, 4>(x, w, y, b, e);
    case WeightKind::kSuperAffine:
      if (w.code_bits == 5) return gemm_range<WeightKind::kSuperAffine, 5>(x, w, y, b, e);
      return gemm_range<WeightKind::kSuperAffine, 4>(x, w, y, b, e);
    case WeightKind::kSuperSym:
      return gemm_range<WeightKind::kSuperSym, 6>(x, w, y, b, e);
  }
}

}  // namespace rebar_cpu_quant
