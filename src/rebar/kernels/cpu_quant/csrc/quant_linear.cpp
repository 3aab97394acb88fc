// y = x @ w.T for every weight kind of kernels.h, on a few activation rows (decode, short chunks).
//
// For one tile of 8 output rows and one activation row, with q_x, d_x the row's int8 blocks:
//   kSym          y[o] = sum_b scale[o, g(b)] * d_x[b] * dot_b(q_w - z, q_x)
//   kAffine       y[o] = sum_b scale[o, g(b)] * d_x[b] * dot_b(q_w, q_x) + sum_g offset[o, g] * sum_{b in g} d_x[b] sum(q_x[b])
//   kSuperAffine  y[o] = sum_b (d[o] sc[o, b]) * d_x[b] * dot_b(q_w, q_x) - sum_b (dmin[o] m[o, b]) * d_x[b] sum(q_x[b])
//   kSuperSym     y[o] = sum_b (d[o] * d_x[b]) * sum_{h in b} sc[o, h] * dot_h(q_w - z, q_x)
// The dots are exact int32 arithmetic; everything after them is float32. Every term multiplies the
// rounded activations, so y is the weights times them (up to float32 round-off).
//
// Up to kMaxRows activation rows are computed together, so each weight block is loaded and unpacked
// once for all of them (batched decode, short prefill chunks).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "block_dots.h"
#include "kernels.h"
#include "simd.h"
#include "worker_pool.h"

namespace rebar_cpu_quant {
namespace {

// How far ahead of the current block to prefetch a thread's weight stream. One core's hardware
// prefetcher alone leaves DRAM latency exposed (~12 GB/s per core here); requesting the lines
// 2 KiB ahead was 10-20% faster for SmolLM2's layers and lm_head.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes) {
  // Near the end this points past the weights: harmless, a prefetch never faults (integer
  // arithmetic, as such a pointer may not be formed).
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(block) + kPrefetchBytes;
  for (int64_t line = 0; line < block_bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
  }
}

// A prefetch of the line `groups_ahead` groups of `group_bytes` past byte `offset` of `base`.
inline void prefetch_groups_ahead(const void* base, int64_t offset, int64_t group_bytes) {
  constexpr int64_t kGroupsAhead = 4;
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(base) + offset + kGroupsAhead * group_bytes;
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
}

// Rows per call of the unsigned kernels: each row keeps two partial sums and a float accumulator.
constexpr int kMaxRows = 4;

// One tile (8 output rows) of an unsigned-code weight against R activation rows starting at `row`.
template <WeightKind kKind, int kBits, int R, bool kHalfScales>
void unsigned_tile_rows(const QuantizedRows& x, const PackedWeights& w, int64_t tile, int64_t row, float* y) {
  constexpr int64_t kBytes = kCodeBlockBytes<kBits>;
  const int64_t num_groups = w.num_blocks / w.blocks_per_group, per_group = w.blocks_per_group;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + tile * w.num_blocks * kBytes;
  const int64_t scale_base = tile * num_groups * kTileRows;
  const int8_t* xq[R];
  const float* xd[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q + (row + r) * x.num_blocks * kBlock;
    xd[r] = x.d + (row + r) * x.num_blocks;
  }

  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m256 scale = load_scales(w.scales, scale_base + g * kTileRows, kHalfScales);  // kAffine's, else d
    __m256 dmin = _mm256_setzero_ps();
    if constexpr (kKind == WeightKind::kSuperAffine) dmin = load_scales(w.offsets, scale_base + g * kTileRows, true);
    // kSuperSym: int8 [16, 8] per tile and super-block; kSuperAffine: the 6-bit pairs, unpacked here.
    constexpr int64_t kSubBytes = kKind == WeightKind::kSuperSym ? 2 * kTileRows * 8 : kKScaleBytes;
    const uint8_t* subs = w.sub_scales + (tile * num_groups + g) * kSubBytes;
    __m256 k_scales[8], k_mins[8];
    if constexpr (kKind == WeightKind::kSuperAffine) k_block_scales(subs, scale, dmin, k_scales, k_mins);
    // Scales, offsets and sub-block scales are streams of their own beside the codes': fetch them a few
    // groups ahead too (measured on a Q4_K weight at one row: 24 GB/s without, 31-37 with).
    constexpr int64_t kScaleBytes = kHalfScales ? 2 : 4;
    prefetch_groups_ahead(w.scales, (scale_base + g * kTileRows) * kScaleBytes, kTileRows * kScaleBytes);
    if (w.offsets) prefetch_groups_ahead(w.offsets, (scale_base + g * kTileRows) * kScaleBytes, kTileRows * kScaleBytes);
    if constexpr (kKind == WeightKind::kSuperAffine || kKind == WeightKind::kSuperSym) {
      prefetch_groups_ahead(subs, 0, kSubBytes);
    }
    for (int64_t i = 0; i < per_group; ++i) {
      const int64_t b = g * per_group + i;
      prefetch_ahead(codes + b * kBytes, kBytes);
      __m256i wv[8];
      load_codes<kBits>(codes + b * kBytes, wv);
      const int8_t* x_block[R];
      for (int r = 0; r < R; ++r) x_block[r] = xq[r] + b * kBlock;
      HalfDot<kBits> lo[R], hi[R];
      block_dots<kBits, R>(wv, x_block, lo, hi);
      if constexpr (kKind == WeightKind::kAffine) {
        for (int r = 0; r < R; ++r) acc[r] = add_scaled_dot(acc[r], block_total(lo[r], hi[r]), scale, xd[r][b]);
      } else if constexpr (kKind == WeightKind::kSym) {
        for (int r = 0; r < R; ++r) {
          const int32_t* sums = x.half_sums + ((row + r) * x.num_blocks + b) * 2;
          acc[r] = add_sym_dot(acc[r], block_total(lo[r], hi[r]), w.zero_point * (sums[0] + sums[1]), scale, xd[r][b]);
        }
      } else if constexpr (kKind == WeightKind::kSuperAffine) {
        for (int r = 0; r < R; ++r) {
          acc[r] = add_scaled_dot(acc[r], block_total(lo[r], hi[r]), k_scales[i], xd[r][b]);
          acc[r] = _mm256_fnmadd_ps(k_mins[i], _mm256_set1_ps(x.group_sums[(row + r) * x.num_blocks + b]), acc[r]);
        }
      } else {
        const __m256i sc_lo = i8x8_to_epi32(subs + 2 * i * kTileRows);
        const __m256i sc_hi = i8x8_to_epi32(subs + (2 * i + 1) * kTileRows);
        for (int r = 0; r < R; ++r) {
          const int32_t* sums = x.half_sums + ((row + r) * x.num_blocks + b) * 2;
          acc[r] = add_sym16_dot(acc[r], lo[r].total(), hi[r].total(), sc_lo, sc_hi, w.zero_point * sums[0],
                                 w.zero_point * sums[1], scale, xd[r][b]);
        }
      }
    }
  }
  if constexpr (kKind == WeightKind::kAffine) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m256 offset = load_scales(w.offsets, scale_base + g * kTileRows, kHalfScales);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.group_sums[(row + r) * num_groups + g]), acc[r]);
      }
    }
  }
  const int64_t first_out = tile * kTileRows;
  const int64_t count = std::min<int64_t>(kTileRows, w.out_features - first_out);
  for (int r = 0; r < R; ++r) store_lanes(y + (row + r) * w.out_features + first_out, acc[r], count);
}

// Tiles [tile_begin, tile_end) on the calling thread. The activation rows are looped inside, so a
// tile's weights are read from memory once and then reused from L1 for every chunk of rows.
template <int kMax, typename Tile>
void tile_range(const QuantizedRows& x, int64_t tile_begin, int64_t tile_end, Tile tile_rows) {
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    int64_t row = 0;
    for (; row + kMax <= x.rows; row += kMax) tile_rows(std::integral_constant<int, kMax>{}, tile, row);
    switch (x.rows - row) {
      case 1: tile_rows(std::integral_constant<int, 1>{}, tile, row); break;
      case 2: if constexpr (kMax > 2) tile_rows(std::integral_constant<int, 2>{}, tile, row); break;
      case 3: if constexpr (kMax > 3) tile_rows(std::integral_constant<int, 3>{}, tile, row); break;
      default: break;
    }
  }
}

template <WeightKind kKind, int kBits, bool kHalf>
void unsigned_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t begin, int64_t end) {
  tile_range<kMaxRows>(x, begin, end, [&](auto rows, int64_t tile, int64_t row) {
    unsigned_tile_rows<kKind, kBits, decltype(rows)::value, kHalf>(x, w, tile, row, y);
  });
}

// The per-group kinds take float16 or float32 scales.
template <WeightKind kKind, int kBits>
void grouped_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t begin, int64_t end) {
  if (w.half_scales) {
    unsigned_range<kKind, kBits, true>(x, w, y, begin, end);
  } else {
    unsigned_range<kKind, kBits, false>(x, w, y, begin, end);
  }
}

}  // namespace

void linear_tile_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin,
                       int64_t tile_end) {
  if (x.rows >= kGemmMinRows) {
    gemm_tile_range(x, w, y, tile_begin, tile_end);
    return;
  }
  tile_begin = pair_rows_tiles(x, w, y, tile_begin, tile_end);
  const int64_t b = tile_begin, e = tile_end;
  switch (w.kind) {
    case WeightKind::kSym:
      if (w.code_bits == 8) return grouped_range<WeightKind::kSym, 8>(x, w, y, b, e);
      if (w.code_bits == 5) return grouped_range<WeightKind::kSym, 5>(x, w, y, b, e);
      return grouped_range<WeightKind::kSym, 4>(x, w, y, b, e);
    case WeightKind::kAffine:
      if (w.code_bits == 5) return grouped_range<WeightKind::kAffine, 5>(x, w, y, b, e);
      return grouped_range<WeightKind::kAffine, 4>(x, w, y, b, e);
    case WeightKind::kSuperAffine:
      if (w.code_bits == 5) return unsigned_range<WeightKind::kSuperAffine, 5, true>(x, w, y, b, e);
      return unsigned_range<WeightKind::kSuperAffine, 4, true>(x, w, y, b, e);
    case WeightKind::kSuperSym:
      return unsigned_range<WeightKind::kSuperSym, 6, true>(x, w, y, b, e);
  }
}

TileRange chunk_tiles(int64_t total, int64_t chunk, int64_t num_chunks) {
  // Chunks begin and end on fours of tiles, so that a job whose tiles come in fours (every model's
  // here) gives pair_rows_tiles whole fours in each chunk; each tile's results are the same anyway.
  constexpr int64_t kAlign = 4;
  const TileRange fours = thread_share((total + kAlign - 1) / kAlign, static_cast<int>(chunk), static_cast<int>(num_chunks));
  return {std::min(total, kAlign * fours.begin), std::min(total, kAlign * fours.end)};
}

// Chunk `chunk` of `num_chunks` of the jobs' tiles laid end to end: a contiguous range (one
// sequential weight stream) that may span the end of one job and the start of the next.
void run_linear_chunk(const LinearJob* jobs, int num_jobs, int64_t chunk, int64_t num_chunks) {
  int64_t total = 0;
  for (int j = 0; j < num_jobs; ++j) total += jobs[j].w->num_tiles;
  const TileRange mine = chunk_tiles(total, chunk, num_chunks);
  int64_t first = 0;
  for (int j = 0; j < num_jobs; ++j) {
    const LinearJob& job = jobs[j];
    const int64_t tiles = job.w->num_tiles;
    const int64_t begin = std::max(mine.begin, first), end = std::min(mine.end, first + tiles);
    if (begin < end) linear_tile_range(*job.x, *job.w, job.y, begin - first, end - first);
    first += tiles;
  }
}

int64_t linear_chunks(const LinearJob* jobs, int num_jobs, int num_threads) {
  int64_t total = 0;
  for (int j = 0; j < num_jobs; ++j) total += jobs[j].w->num_tiles;
  return std::min<int64_t>(total, 4 * std::max(num_threads, 1));
}

// A few chunks per thread, run on the WorkerPool, which never waits for a helper thread that is
// not running; a late helper still finds chunks to take.
void run_linears(const LinearJob* jobs, int num_jobs, int num_threads) {
  const int64_t num_chunks = linear_chunks(jobs, num_jobs, num_threads);
  WorkerPool::shared(num_threads).run(num_chunks, num_threads, [&](int64_t chunk) {
    run_linear_chunk(jobs, num_jobs, chunk, num_chunks);
  });
}

}  // namespace rebar_cpu_quant
