// Each row's best output of y = x @ w.T, found as the outputs are computed, without writing y: a
// greedy step needs only its rows' best tokens, and on a wide vocabulary (Gemma 3: 262,144 outputs,
// a MiB a row) writing every logit and reading it back costs a share of the output head's time.
//
// A chunk computes its tiles a span at a time into a small buffer that stays in cache, with the same
// kernels linear_tile_range runs (so every output has the bits linear_packed would give it), and
// keeps each row's first largest value; the chunks' bests are then merged in output order.
#include "best_outputs.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "block_dots.h"

namespace rebar_cpu_quant {

namespace {

// Tiles of one span: 512 outputs a row, 34 KiB of buffer for 17 rows.
constexpr int64_t kSpanTiles = 64;

// Tiles [first, first + count) of w as a weight of their own (every array is laid out by tile).
PackedWeights tile_span(const PackedWeights& w, int64_t first, int64_t count) {
  const int64_t groups = w.num_blocks / w.blocks_per_group;
  const int64_t scale_bytes = w.half_scales ? 2 : 4;
  const int64_t sub_bytes = w.kind == WeightKind::kSuperAffine ? groups * kKScaleBytes
                                                               : groups * 2 * w.blocks_per_group * kTileRows;
  PackedWeights span = w;
  span.codes = w.codes + first * w.num_blocks * kBlock * w.code_bits;
  span.scales = static_cast<const uint8_t*>(w.scales) + first * groups * kTileRows * scale_bytes;
  if (w.offsets) span.offsets = static_cast<const uint8_t*>(w.offsets) + first * groups * kTileRows * scale_bytes;
  if (w.sub_scales) span.sub_scales = w.sub_scales + first * sub_bytes;
  span.num_tiles = count;
  span.out_features = std::min(count * kTileRows, w.out_features - first * kTileRows);
  return span;
}

// Keeps the first largest: `later` covers outputs after those `best` has seen.
void merge(BestValue& best, const BestValue& later, int64_t offset) {
  best.nan = best.nan || later.nan;
  if (later.value > best.value) best.value = later.value, best.index = offset + later.index;
}

BestValue no_best() { return {0, -std::numeric_limits<float>::infinity(), false}; }

}  // namespace

void best_outputs_range(const QuantizedRows& x, const PackedWeights& w, int64_t tile_begin, int64_t tile_end,
                        float* buffer, BestValue* best) {
  for (int64_t r = 0; r < x.rows; ++r) best[r] = no_best();
  for (int64_t first = tile_begin; first < tile_end; first += kSpanTiles) {
    const PackedWeights span = tile_span(w, first, std::min(kSpanTiles, tile_end - first));
    linear_tile_range(x, span, buffer, 0, span.num_tiles);
    for (int64_t r = 0; r < x.rows; ++r) {
      merge(best[r], best_value(buffer + r * span.out_features, span.out_features), first * kTileRows);
    }
  }
}

int64_t best_outputs_buffer_floats(int64_t rows) { return rows * kSpanTiles * kTileRows; }

void merge_best_outputs(const BestValue* chunks, int64_t num_chunks, int64_t rows, BestValue* best) {
  for (int64_t r = 0; r < rows; ++r) {
    best[r] = no_best();
    for (int64_t c = 0; c < num_chunks; ++c) merge(best[r], chunks[c * rows + r], 0);
  }
}

}  // namespace rebar_cpu_quant
