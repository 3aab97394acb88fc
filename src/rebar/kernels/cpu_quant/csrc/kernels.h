// Quantized-weight linear kernels for x86 CPUs: AVX2 + FMA, with AVX-512 VNNI or AVX-VNNI integer
// dot products where the CPU has them (simd.h; the build picks the widest, build.py).
//
// Activations are quantized to int8 per block of 32 values (one float scale per block); weights are
// unsigned codes with float scales (kinds below). The dot product of a weight block with an
// activation block is computed exactly in integers and only per-block sums are scaled in float.
//
// Weight kinds, each mapping one family of GGUF block types exactly (w = the value llama.cpp
// decodes); every code is unsigned, q in 0..2^bits - 1:
//   kSym          w = scale[g] * (q - zero_point), one scale per group of blocks_per_group blocks,
//                 float32 or float16: Q4_0 (4 bits, zero point 8), Q5_0 (5, 16), Q8_0 and rebar's
//                 int8 checkpoints (8 bits: the signed code plus 128, zero point 128).
//   kAffine       w = scale[g] * q + offset[g], one (scale, offset) per group: Q4_1, Q5_1 and
//                 rebar's own int4 checkpoints.
//   kSuperAffine  w = d * sc[b] * q - dmin * m[b]: float16 d and dmin per super-block of
//                 blocks_per_group (8) blocks, 6-bit sc and m per block of 32 (packed, 96 bytes per
//                 tile and super-block: k_block_scales in block_dots.h): Q4_K, Q5_K.
//   kSuperSym     w = d * sc[h] * (q - zero_point): float16 d per super-block, int8 sc per half-block
//                 of 16: Q6_K (zero point 32).
// Zero points are applied in integers (the dot product of q - z is the dot of q minus z times the
// activation codes' sum), so the symmetric kinds need no offset term at all.
//
// Packed weight layout (built in Python by packing.py): output rows are grouped in tiles of
// kTileRows = 8, so that one AVX2 float register holds the 8 outputs of a tile and no horizontal sum
// is needed per output. Within a tile, the blocks of all 8 rows are interleaved so a tile's weights are
// one sequential stream:
//   codes          [num_tiles, num_blocks, bits, 32] uint8: in chunk c < 4, byte 4 * row + j = low 4
//                  bits of the code of column 4c + j (low nibble) | of column 16 + 4c + j (high
//                  nibble); then bits - 4 vectors of the codes' high bits (load_codes, block_dots.h);
//                  8-bit codes: byte 4 * row + j of vector k = the code of column 4k + j
//   scales/offs    [num_tiles, num_groups, 8]     float32 or float16 (as raw uint16 bits)
//   sub-scales     kSuperAffine [num_tiles, num_groups, 96] uint8; kSuperSym [num_tiles, num_groups, 16, 8] int8
// Rows past the real output size are zero-filled and never stored.
#pragma once

#include <algorithm>
#include <cstdint>

namespace rebar_cpu_quant {

constexpr int64_t kBlock = 32;    // activation quantization block, in values
constexpr int64_t kTileRows = 8;  // output rows per tile: one lane of a __m256 each

enum class WeightKind : int { kSym = 0, kAffine = 1, kSuperAffine = 2, kSuperSym = 3 };

// Activations of `rows` rows quantized per block of 32: q = round(x / d), d = max|x| / 127.
struct QuantizedRows {
  const int8_t* q;           // [rows, num_blocks * 32], zero past `in`
  const float* d;            // [rows, num_blocks]
  const float* group_sums;   // [rows, num_blocks / blocks_per_sum] sums of the rounded x (d * q); may be null
  const int32_t* half_sums;  // [rows, num_blocks * 2] sums of q over each half-block of 16
  int64_t rows;
  int64_t num_blocks;
};

// Quantize x [rows, in] (row-major). `blocks_per_sum` sizes group_sums (0: not computed). With
// `half_scales`, d and each block's rounded sum d * sum(q) are rounded to float16 (the codes are not:
// they come from the exact scale), as llama.cpp's Q8_0 / Q8_1 activation blocks store them.
void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t num_blocks, int64_t blocks_per_sum, int8_t* q,
                   float* d, float* group_sums, int32_t* half_sums, bool half_scales);

struct PackedWeights {
  WeightKind kind;
  int code_bits;               // 4, 5, 6 or 8
  const uint8_t* codes;        // [tiles, blocks, code_bits, 32]
  const void* scales;          // kSym/kAffine: [tiles, groups, 8]; super kinds: d [tiles, groups, 8] float16
  const void* offsets;         // kAffine: [tiles, groups, 8]; kSuperAffine: dmin [tiles, groups, 8] float16
  const uint8_t* sub_scales;   // kSuperAffine: [tiles, groups, 96] packed 6-bit pairs; kSuperSym: [tiles, groups, 16, 8]
  bool half_scales;            // scales/offsets are float16 bits (else float32); always true for super kinds
  int zero_point;              // kSym, kSuperSym
  int64_t num_tiles;
  int64_t num_blocks;        // blocks of 32 input columns per row
  int64_t blocks_per_group;  // blocks sharing one scale (a super-block's blocks for the super kinds)
  int64_t out_features;      // rows of y actually written (<= num_tiles * 8)
};

// Whether the kind's activation blocks keep float16 scales: llama.cpp multiplies the weight types
// kSym and kAffine map (Q4_0, Q5_0, Q8_0; Q4_1, Q5_1) by Q8_0 / Q8_1 blocks, whose d (and s, the
// block's rounded sum) are float16, so rebar rounds them alike; the K-quants' Q8_K blocks keep float32.
inline bool half_activation_scales(const PackedWeights& w) {
  return w.kind == WeightKind::kSym || w.kind == WeightKind::kAffine;
}

// Blocks per sum of the rounded x that the kind's offsets multiply (0: it needs none).
inline int64_t blocks_per_sum(const PackedWeights& w) {
  switch (w.kind) {
    case WeightKind::kAffine: return w.blocks_per_group;
    case WeightKind::kSuperAffine: return 1;
    default: return 0;
  }
}

// One y [rows, out_features] = x @ w.T.
struct LinearJob {
  const QuantizedRows* x;
  const PackedWeights* w;
  float* y;
};

// Runs every job, their output tiles split over `num_threads` threads of the WorkerPool as one piece
// of work (so q, k and v, say, share one synchronisation).
void run_linears(const LinearJob* jobs, int num_jobs, int num_threads);

// The same work as independent chunks, for callers that run them on another thread pool:
// linear_chunks() of them, each done by run_linear_chunk(); together they write every output.
int64_t linear_chunks(const LinearJob* jobs, int num_jobs, int num_threads);
void run_linear_chunk(const LinearJob* jobs, int num_jobs, int64_t chunk, int64_t num_chunks);

// Tiles [tile_begin, tile_end) of y = x @ w.T on the calling thread, for callers that schedule
// several linears inside one parallel region.
void linear_tile_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin,
                       int64_t tile_end);

// linear_tile_range for many rows (quant_gemm.cpp): the same results, scheduled for compute-bound
// batches; used from kGemmMinRows rows on. At 32 and 48 rows it was 10-30% faster than the
// small-batch schedule on Gemma 3's and SmolLM2's layers and output heads; at 12-24 rows it was not
// on every weight (docs/kernels.md, "Prefill").
constexpr int64_t kGemmMinRows = 32;
void gemm_tile_range(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin,
                     int64_t tile_end);

// From this many rows (and below kGemmMinRows), AVX-512 builds compute tiles four at a time against six
// rows at a time (four for kSuperSym; pair_rows.cpp): the same results as the small-batch kernel.
// Below it the small-batch kernel's single weight stream is as fast (the output head at 4 rows).
constexpr int64_t kPairRowsMinRows = 6;
// From kPairRowsMinRows rows on AVX-512 builds, tiles from tile_begin on, four at a time while four
// remain before tile_end; returns the first tile it left for the caller (tile_begin when it took none:
// fewer rows or another build; else at most three before tile_end).
int64_t pair_rows_tiles(const QuantizedRows& x, const PackedWeights& w, float* y, int64_t tile_begin, int64_t tile_end);

// The contiguous share [begin, end) of `count` items that thread `thread` of `num_threads` takes.
struct TileRange {
  int64_t begin, end;
};
inline TileRange thread_share(int64_t count, int thread, int num_threads) {
  const int64_t base = count / num_threads, extra = count % num_threads;
  const int64_t begin = thread * base + std::min<int64_t>(thread, extra);
  return {begin, begin + base + (thread < extra ? 1 : 0)};
}

// The tiles chunk `chunk` of `num_chunks` takes of `total` laid end to end (run_linear_chunk's split).
TileRange chunk_tiles(int64_t total, int64_t chunk, int64_t num_chunks);

}  // namespace rebar_cpu_quant
