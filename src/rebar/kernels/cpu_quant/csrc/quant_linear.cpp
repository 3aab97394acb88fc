// y = x @ w.T for int4 (scale + offset per group) and int8 (scale per group) packed weights.
//
// For one tile of 8 output rows and one activation row:
//   y[o] = sum_b scale[o, g(b)] * d_x[b] * sum_{c in b} q_w[o,c] * q_x[c]   (int4 and int8)
//        + sum_g offset[o,g] * sum_{c in g} x[c]                            (int4 only)
// The innermost sum is exact int32 arithmetic; everything after it is float32.
//
// Up to Format::kMaxRows activation rows are computed together, so each weight block is loaded
// and unpacked once for all of them (batched decode, short prefill chunks).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "simd.h"
#include "worker_pool.h"

namespace rebar_cpu_quant {
namespace {

// How far ahead of the current block to prefetch a thread's weight stream. One core's hardware
// prefetcher alone leaves DRAM latency exposed (~12 GB/s per core here); requesting the lines
// 2 KiB ahead was 10-20% faster for SmolLM2's layers and lm_head.
constexpr int64_t kPrefetchBytes = 2048;

// 4-bit codes: 128 bytes per tile and block, as four 32-byte chunks. Byte 4*o + j of chunk c holds
// output row o's codes for columns 4c + j (low nibble) and 16 + 4c + j (high nibble). maddubs of a
// chunk's nibbles against four activations broadcast to every row then leaves output row o's partial
// sums in the two int16 lanes of dword o: the tile's eight dot products come out in the eight int32
// lanes without any horizontal sums.
struct Int4Format {
  static constexpr int64_t kBlockBytes = 16;
  static constexpr bool kHasOffsets = true;
  static constexpr int kMaxRows = 4;

  template <int R>
  static void block_dots(const uint8_t* codes, const int8_t* const x[R], __m256i dots[R]) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    // int16 lanes gather 8 pair sums of at most 2 * 15 * 127: 30480, within int16.
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c));
      const __m256i w_low = _mm256_and_si256(raw, low_nibbles);                        // cols 4c..4c+3
      const __m256i w_high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);  // cols 16+4c..
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        // maddubs: unsigned weights (0..15) x signed activations (|q| <= 127) summed in pairs.
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(w_low, broadcast4(x[r] + 4 * c)));
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(w_high, broadcast4(x[r] + 16 + 4 * c)));
      }
    }
    for (int r = 0; r < R; ++r) dots[r] = _mm256_madd_epi16(sums[r], _mm256_set1_epi16(1));
  }
};

// 8-bit signed codes: 32 bytes per row and block, rows in natural order.
struct Int8Format {
  static constexpr int64_t kBlockBytes = 32;
  static constexpr bool kHasOffsets = false;
  static constexpr int kMaxRows = 2;  // each row keeps more partial sums live than int4 does

  template <int R>
  static void block_dots(const uint8_t* codes, const int8_t* const x[R], __m256i dots[R]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums[R][kTileRows];
#pragma GCC unroll 8
    for (int k = 0; k < kTileRows; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + kBlockBytes * k));
      // maddubs needs one unsigned operand: use |w| and move w's sign onto the activations.
      // |-128| = 128 still fits as unsigned, and activations are within [-127, 127], so pair
      // sums stay within 2 * 128 * 127 < 32768.
      const __m256i w_abs = _mm256_abs_epi8(w);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i xr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r]));
        sums[r][k] = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xr, w)), ones);
      }
    }
    for (int r = 0; r < R; ++r) dots[r] = sum_lanes_of_8(sums[r]);
  }
};

// One tile (8 output rows) against R activation rows starting at `row`.
template <typename Format, int R, bool kHalfScales>
void tile_rows(const QuantizedRows& x, const PackedWeights& w, int64_t tile, int64_t row, float* y) {
  const int64_t num_groups = w.num_blocks / w.blocks_per_group;
  const int64_t block_stride = kTileRows * Format::kBlockBytes;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + tile * w.num_blocks * block_stride;
  const int64_t scale_base = tile * num_groups * kTileRows;
  const int8_t* xq[R];
  const float* xd[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q + (row + r) * x.num_blocks * kBlock;
    xd[r] = x.d + (row + r) * x.num_blocks;
  }

  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < num_groups; ++g) {
    const __m256 scale = load_scales(w.scales, scale_base + g * kTileRows, kHalfScales);
    for (const int64_t group_end = b + w.blocks_per_group; b < group_end; ++b) {
      // Near the end this points past the weights: harmless, a prefetch never faults (integer
      // arithmetic, as such a pointer may not be formed).
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(codes) + b * block_stride + kPrefetchBytes;
      for (int64_t line = 0; line < block_stride; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      }
      const int8_t* x_block[R];
      for (int r = 0; r < R; ++r) x_block[r] = xq[r] + b * kBlock;
      __m256i dots[R];
      Format::template block_dots<R>(codes + b * block_stride, x_block, dots);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 block_scale = _mm256_mul_ps(scale, _mm256_set1_ps(xd[r][b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), block_scale, acc[r]);
      }
    }
  }
  if constexpr (Format::kHasOffsets) {
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
template <typename Format, bool kHalfScales>
void tile_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin, int64_t tile_end) {
  constexpr int kMax = Format::kMaxRows;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    int64_t row = 0;
    for (; row + kMax <= x.rows; row += kMax) tile_rows<Format, kMax, kHalfScales>(x, w, tile, row, y);
    switch (x.rows - row) {
      case 1: tile_rows<Format, 1, kHalfScales>(x, w, tile, row, y); break;
      case 2: if constexpr (kMax > 2) tile_rows<Format, 2, kHalfScales>(x, w, tile, row, y); break;
      case 3: if constexpr (kMax > 3) tile_rows<Format, 3, kHalfScales>(x, w, tile, row, y); break;
      default: break;
    }
  }
}

template <typename Format>
void tile_range_any_scales(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t begin, int64_t end) {
  if (w.half_scales) {
    tile_range<Format, true>(x, w, y, begin, end);
  } else {
    tile_range<Format, false>(x, w, y, begin, end);
  }
}

}  // namespace

void linear_tile_range(const QuantizedRows& x, const PackedWeights& w, int bits, float* y, int64_t tile_begin,
                       int64_t tile_end) {
  if (bits == 4 && x.rows >= kInt4GemmMinRows) {
    int4_gemm_tile_range(x, w, y, tile_begin, tile_end);
  } else if (bits == 4) {
    tile_range_any_scales<Int4Format>(x, w, y, tile_begin, tile_end);
  } else {
    tile_range_any_scales<Int8Format>(x, w, y, tile_begin, tile_end);
  }
}

// Chunk `chunk` of `num_chunks` of the jobs' tiles laid end to end: a contiguous range (one
// sequential weight stream) that may span the end of one job and the start of the next.
void run_linear_chunk(const LinearJob* jobs, int num_jobs, int64_t chunk, int64_t num_chunks) {
  int64_t total = 0;
  for (int j = 0; j < num_jobs; ++j) total += jobs[j].w->num_tiles;
  const TileRange mine = thread_share(total, static_cast<int>(chunk), static_cast<int>(num_chunks));
  int64_t first = 0;
  for (int j = 0; j < num_jobs; ++j) {
    const LinearJob& job = jobs[j];
    const int64_t tiles = job.w->num_tiles;
    const int64_t begin = std::max(mine.begin, first), end = std::min(mine.end, first + tiles);
    if (begin < end) linear_tile_range(*job.x, *job.w, job.bits, job.y, begin - first, end - first);
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
