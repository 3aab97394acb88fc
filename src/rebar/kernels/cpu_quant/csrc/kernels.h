// Quantized-weight linear kernels for x86 CPUs with AVX2 + FMA.
//
// Activations are quantized to int8 per block of 32 values (one float scale per block), weights are
// 4-bit (with a per-group scale and offset) or 8-bit (per-group scale); the dot product of a weight
// block with an activation block is computed exactly in integers with _mm256_maddubs_epi16 and only
// the per-block sums are scaled in float.
//
// Packed weight layout (built in Python by packing.py): output rows are grouped in tiles of
// kTileRows = 8, so that one AVX2 float register holds the 8 outputs of a tile and no horizontal sum
// is needed per output. Within a tile, the blocks of all 8 rows are interleaved so a tile's weights are
// one sequential stream:
//   int4 codes   [num_tiles, num_blocks, 4, 32] uint8: in chunk c, byte 4 * row + j = code of column
//                                                 4c + j (low nibble) | code of column 16 + 4c + j (high)
//   int8 codes   [num_tiles, num_blocks, 8, 32] int8
//   scales/offs  [num_tiles, num_groups, 8]     float32 or float16 (as raw uint16 bits)
// Rows past the real output size are zero-filled and never stored.
#pragma once

#include <algorithm>
#include <cstdint>

namespace rebar_cpu_quant {

constexpr int64_t kBlock = 32;    // activation quantization block, in values
constexpr int64_t kTileRows = 8;  // output rows per tile: one lane of a __m256 each

// Activations of `rows` rows quantized per block of 32: q = round(x / d), d = max|x| / 127.
struct QuantizedRows {
  const int8_t* q;           // [rows, num_blocks * 32], zero past `in`
  const float* d;            // [rows, num_blocks]
  const float* group_sums;   // [rows, num_groups] exact float sums of x per weight group; may be null
  int64_t rows;
  int64_t num_blocks;
};

// Quantize x [rows, in] (row-major). `blocks_per_group` sizes group_sums (null: not computed).
void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t num_blocks,
                   int64_t blocks_per_group, int8_t* q, float* d, float* group_sums);

struct PackedWeights {
  const void* codes;       // int4: uint8 [tiles, blocks, 4, 32]; int8: int8 [tiles, blocks, 8, 32]
  const void* scales;      // [tiles, groups, 8]
  const void* offsets;     // [tiles, groups, 8], int4 only
  bool half_scales;        // scales/offsets are float16 bits (else float32)
  int64_t num_tiles;
  int64_t num_blocks;        // blocks of 32 input columns per row
  int64_t blocks_per_group;  // blocks sharing one scale
  int64_t out_features;      // rows of y actually written (<= num_tiles * 8)
};

// One y [rows, out_features] = x @ w.T (bits 4 or 8).
struct LinearJob {
  const QuantizedRows* x;
  const PackedWeights* w;
  int bits;
  float* y;
};

// Runs every job, their output tiles split over `num_threads` threads of the WorkerPool as one piece
// of work (so q, k and v, say, share one synchronisation).
void run_linears(const LinearJob* jobs, int num_jobs, int num_threads);

// The same work as independent chunks, for callers that run them on another thread pool:
// linear_chunks() of them, each done by run_linear_chunk(); together they write every output.
int64_t linear_chunks(const LinearJob* jobs, int num_jobs, int num_threads);
void run_linear_chunk(const LinearJob* jobs, int num_jobs, int64_t chunk, int64_t num_chunks);

// Tiles [tile_begin, tile_end) of y = x @ w.T (bits 4 or 8) on the calling thread, for callers that
// schedule several linears inside one parallel region.
void linear_tile_range(const QuantizedRows& x, const PackedWeights& w, int bits, float* y, int64_t tile_begin,
                       int64_t tile_end);

// linear_tile_range for int4 weights and many rows (quant_gemm.cpp): the same results, scheduled for
// compute-bound batches; used from kInt4GemmMinRows rows on.
constexpr int64_t kInt4GemmMinRows = 64;
void int4_gemm_tile_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin,
                          int64_t tile_end);

// The contiguous share [begin, end) of `count` items that thread `thread` of `num_threads` takes.
struct TileRange {
  int64_t begin, end;
};
inline TileRange thread_share(int64_t count, int thread, int num_threads) {
  const int64_t base = count / num_threads, extra = count % num_threads;
  const int64_t begin = thread * base + std::min<int64_t>(thread, extra);
  return {begin, begin + base + (thread < extra ? 1 : 0)};
}

}  // namespace rebar_cpu_quant
