// The fused decode step of decoder.h: every layer for a few rows, the parallel parts on a WorkerPool.
#include "decoder.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "elementwise.h"
#include "simd.h"
#include "worker_pool.h"

namespace rebar_cpu_quant {
namespace {

void rms_norm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  double sum_squares = 0.0;
  for (int64_t i = 0; i < n; ++i) sum_squares += static_cast<double>(x[i]) * x[i];
  const float inv_rms = 1.0f / std::sqrt(static_cast<float>(sum_squares / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv_rms);
}

// One linear's input, quantized as its kernel reads it (the affine kinds need float sums for their
// offsets).
struct QuantizedInput {
  std::vector<int8_t> q;
  std::vector<float> d, group_sums;
  std::vector<int32_t> half_sums;
  QuantizedRows rows{};

  void quantize(const float* x, int64_t num_rows, const QuantLinearRef& linear) {
    const PackedWeights& w = linear.weights;
    const int64_t per_sum = blocks_per_sum(w);
    q.resize(num_rows * w.num_blocks * kBlock);
    d.resize(num_rows * w.num_blocks);
    half_sums.resize(num_rows * w.num_blocks * 2);
    float* sums = nullptr;
    if (per_sum > 0) {
      group_sums.resize(num_rows * (w.num_blocks / per_sum));
      sums = group_sums.data();
    }
    quantize_rows(x, num_rows, linear.in_features, w.num_blocks, per_sum, q.data(), d.data(), sums, half_sums.data(),
                  half_activation_scales(w));
    rows = {q.data(), d.data(), sums, half_sums.data(), num_rows, w.num_blocks};
  }
};

// Whether two linears read an input alike: the same blocks, the same float sums (whose groups
// the offsets need) and the same precision of block scales. Then one quantized copy of the input
// serves both.
bool reads_alike(const QuantLinearRef& a, const QuantLinearRef& b) {
  return a.weights.num_blocks == b.weights.num_blocks && blocks_per_sum(a.weights) == blocks_per_sum(b.weights) &&
         half_activation_scales(a.weights) == half_activation_scales(b.weights);
}

// The input x of `linear`, quantized: `first_input` (x quantized for `first`) when the two read it
// alike, else `own` filled for it.
const QuantizedInput& input_for(const QuantLinearRef& linear, const float* x, int64_t rows, QuantizedInput& own,
                                const QuantLinearRef& first, const QuantizedInput& first_input) {
  if (reads_alike(linear, first)) return first_input;
  own.quantize(x, rows, linear);
  return own;
}

// One of a layer's linears on its quantized input.
LinearJob job(const QuantLinearRef& linear, const QuantizedInput& input, float* y) {
  return {&input.rows, &linear.weights, y};
}

// x += y, each row of y normed first when `norm` is given (Gemma 3's norms on the attention's and the
// MLP's outputs).
void add_residual(float* x, float* y, const float* norm, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y + r * n;
    if (norm) rms_norm(row, norm, row, n, eps);
    for (int64_t i = 0; i < n; ++i) x[r * n + i] += row[i];
  }
}

void add_bias(float* y, const float* bias, int64_t rows, int64_t n) {
  if (!bias) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) y[r * n + i] += bias[i];
  }
}

// One piece of a step's attention: a row's query heads sharing `kv_head`, over positions
// [begin, end) of its context. A context longer than kAttendPartition positions is split into
// pieces of that many, so that one long sequence's attention spreads over every thread; each piece
// then leaves its unnormalised output and, per head, its maximum score and sum of exponentials, for
// combine_pieces. How a context is split depends only on its length, never on the batch, so a
// row's numbers do not depend on what shares its step.
struct AttendItem {
  int64_t row, kv_head, begin, end;
  int64_t piece;  // index into Scratch's piece buffers when the context is split, else -1
};

// A split context: pieces [first_piece, first_piece + num_pieces) of one (row, KV head).
struct SplitContext {
  int64_t row, kv_head, first_piece, num_pieces;
};

constexpr int64_t kAttendPartition = 256;

// The window of positions a row attends over: [first, context).
int64_t window_start(int64_t window, int64_t context) {
  return window > 0 ? std::max<int64_t>(0, context - window) : 0;
}

// The pieces of a step's attention over one kind of layer (whole contexts, or windowed ones): the
// same for every layer of that kind, since the split depends only on each row's visible length.
struct AttentionPlan {
  std::vector<AttendItem> items;
  std::vector<SplitContext> splits;

  // Pieces are numbered from `first_piece` on (two plans share the piece buffers); returns the next free one.
  int64_t build(const DecoderShape& s, const DecodeBatch& batch, int64_t window, int64_t first_piece) {
    int64_t num_pieces = first_piece;
    for (int64_t r = 0; r < batch.rows; ++r) {
      const int64_t context = batch.context_lens[r], first = window_start(window, context);
      const int64_t pieces = (context - first + kAttendPartition - 1) / kAttendPartition;
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        if (pieces == 1) {
          items.push_back({r, h, first, context, -1});
          continue;
        }
        splits.push_back({r, h, num_pieces, pieces});
        for (int64_t begin = first; begin < context; begin += kAttendPartition) {
          items.push_back({r, h, begin, std::min(context, begin + kAttendPartition), num_pieces++});
        }
      }
    }
    // Items that read the same cache rows (a piece of one sequence's context seen by each of its
    // rows in a step checking drafts, or a cached prefix that sequences share) run one after the
    // other, so that after the first each finds the piece in cache rather than in memory. The
    // order never changes what an item computes.
    const auto first_block = [&](const AttendItem& item) {
      return batch.block_tables[item.row * batch.table_width + item.begin / s.block_size];
    };
    std::stable_sort(items.begin(), items.end(), [&](const AttendItem& a, const AttendItem& b) {
      return std::make_tuple(first_block(a), a.begin, a.kv_head) < std::make_tuple(first_block(b), b.begin, b.kv_head);
    });
    return num_pieces;
  }
};

// Buffers for one step, shared by the threads (each writes its own part).
struct Scratch {
  std::vector<float> normed, q, k, v, attn, proj, gate, up;
  AttentionPlan plans[2];          // [0]: whole contexts; [1]: the sliding window (windowed layers)
  std::vector<float> piece_out;    // [pieces, group, head_dim]: each piece's unnormalised output
  std::vector<float> piece_stats;  // [pieces, group, 2]: each head's maximum score and sum of e^(score - max)
  QuantizedInput qkv_in[3], o_in, gate_up_in[2], down_in;

  Scratch(const DecoderShape& s, const DecodeBatch& batch)
      : normed(batch.rows * s.hidden),
        q(batch.rows * s.num_heads * s.head_dim),
        k(batch.rows * s.num_kv_heads * s.head_dim),
        v(batch.rows * s.num_kv_heads * s.head_dim),
        attn(batch.rows * s.num_heads * s.head_dim),
        proj(batch.rows * s.hidden),
        gate(batch.rows * s.intermediate),
        up(batch.rows * s.intermediate) {
    int64_t num_pieces = plans[0].build(s, batch, 0, 0);
    if (s.sliding_window > 0) num_pieces = plans[1].build(s, batch, s.sliding_window, num_pieces);
    const int64_t group = s.num_heads / s.num_kv_heads;
    piece_out.resize(num_pieces * group * s.head_dim);
    piece_stats.resize(num_pieces * group * 2);
  }
};

// KV-cache storage: float32, float16 (uint16_t bits, converted with F16C on the way in and out) or
// Q8_0 blocks (rebar.kernels.kv_quant: a float16 scale d, then 32 int8 codes; value = code * d).
// A head's row is head_dim / kValuesPer<T> units of T; load8(row, i) widens values i..i+7 of a row
// (i a multiple of 8) to float32.
struct __attribute__((packed)) Q8Block {
  uint16_t d;
  int8_t codes[32];
};
static_assert(sizeof(Q8Block) == 34, "Q8_0 blocks are 34 bytes, as llama.cpp's");

template <typename T>
constexpr int64_t kValuesPer = 1;
template <>
constexpr int64_t kValuesPer<Q8Block> = 32;

inline __m256 load8(const float* row, int64_t i) { return _mm256_loadu_ps(row + i); }
inline __m256 load8(const uint16_t* row, int64_t i) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
}
inline __m256 load8(const Q8Block* row, int64_t i) {
  const Q8Block& block = row[i / 32];
  const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block.codes + i % 32)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(_cvtsh_ss(block.d)));
}

// Stores n values (a multiple of 8; of 32 for Q8_0) at dst, rounding to nearest-even for float16 as
// torch does.
inline void store_cache_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store_cache_row(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}
// As kv_quant.quantize (and llama.cpp's x86 quantize_row_q8_0): codes x * (127 / max|x|) rounded half
// to even, the scale max|x| / 127 stored as float16; the same bytes, so every path reads the same values.
inline void store_cache_row(Q8Block* dst, const float* src, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* x = src + 32 * b;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float inverse = amax > 0 ? 127.0f / amax : 0.0f;
    dst[b].d = _cvtss_sh(amax / 127, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    for (int j = 0; j < 32; ++j) dst[b].codes[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
  }
}

template <typename T>
void write_kv(const DecoderShape& s, const DecoderLayerRef& layer, int64_t slot, const float* k, const float* v) {
  const int64_t kv_size = s.num_kv_heads * s.head_dim, units = kv_size / kValuesPer<T>;
  store_cache_row(static_cast<T*>(layer.key_cache) + slot * units, k, kv_size);
  store_cache_row(static_cast<T*>(layer.value_cache) + slot * units, v, kv_size);
}

// Walks a row's cache slots for positions start, start + 1, ... without a division per position.
class SlotCursor {
 public:
  SlotCursor(const int64_t* table, int64_t block_size, int64_t position)
      : table_(table), block_size_(block_size), block_(position / block_size), offset_(position % block_size) {}
  int64_t slot() const { return table_[block_] * block_size_ + offset_; }
  void next() {
    if (++offset_ == block_size_) {
      offset_ = 0;
      ++block_;
    }
  }

 private:
  const int64_t* table_;
  int64_t block_size_, block_, offset_;
};

// x[t] = e^(x[t] - shift) for t < n, returning their sum: two vector accumulators, so the sum is not
// one chain of n dependent adds (that chain alone was a sixth of the attention's time).
inline float exp_and_sum(float* x, int64_t n, float shift) {
  const __m256 offset = _mm256_set1_ps(shift);
  __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), offset));
    _mm256_storeu_ps(x + i, e);
    sums[(i / 8) % 2] = _mm256_add_ps(sums[(i / 8) % 2], e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(sums[0], sums[1]));
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  if (i < n) {  // the ragged end, through a zero-padded copy
    alignas(32) float tail[8] = {};
    std::memcpy(tail, x + i, sizeof(float) * (n - i));
    _mm256_store_ps(tail, exp256(_mm256_sub_ps(_mm256_load_ps(tail), offset)));
    std::memcpy(x + i, tail, sizeof(float) * (n - i));
    for (int64_t t = 0; t < n - i; ++t) total += tail[t];
  }
  return total;
}

// Scores (q . k) * scale of eight keys for H query heads, out[h][j]: each slice of a key is widened
// once for all H heads (it was once per head, three times the conversions for SmolLM2's groups).
// Each (head, key) sum runs over head_dim in order, as a single head's would.
#if defined(__AVX512VL__)
constexpr int64_t kScoreHeads = 3;  // 3 x 8 accumulators of the 32 registers
#else
constexpr int64_t kScoreHeads = 1;  // 8 accumulators of the 16 registers
#endif

template <int H, typename T>
inline void score_keys(const T* const keys[8], const float* queries, int64_t head_dim, __m256 scale,
                       float out[][8]) {
  __m256 partial[H][8];
  for (int h = 0; h < H; ++h) {
    for (int j = 0; j < 8; ++j) partial[h][j] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < head_dim; i += 8) {
    __m256 q[H];
    for (int h = 0; h < H; ++h) q[h] = _mm256_loadu_ps(queries + h * head_dim + i);
    for (int j = 0; j < 8; ++j) {
      const __m256 k = load8(keys[j], i);
      for (int h = 0; h < H; ++h) partial[h][j] = _mm256_fmadd_ps(q[h], k, partial[h][j]);
    }
  }
  for (int h = 0; h < H; ++h) _mm256_store_ps(out[h], _mm256_mul_ps(sum_lanes_of_8_ps(partial[h]), scale));
}

inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(static_cast<const char*>(row) + line, _MM_HINT_T0);
  }
}

// Requests a piece's key and value rows into L2 all at once, before any of them is used. One core's
// loads into L1 keep only a few cache misses in flight, so streaming a long context through them
// alone left its attention at ~8 GB/s; a burst of L2 requests keeps the memory busy. Measured at
// 4,096 tokens of context (SmolLM2, 2 threads): the fused step 13-15 ms -> 9.3-10.7 ms; fetching a
// rolling distance ahead instead, or the whole row of every KV head per piece, was slower.
template <typename T>
void fetch_piece_into_l2(const T* key_cache, const T* value_cache, const int64_t* offsets, int64_t count,
                         int64_t row_bytes) {
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t line = 0; line < row_bytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(key_cache + offsets[t]) + line, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(value_cache + offsets[t]) + line, _MM_HINT_T1);
    }
  }
}

// out[h][i] = sum_t p[h][t] * v_t[i] for H query heads, each sum taken in position order. Each
// position's values are loaded once for all H heads, a pass covering S 8-wide slices of head_dim, so
// H * S independent accumulators hide the multiply-adds' latency (one chain per slice, as an
// accumulator per slice over all positions would be, was latency-bound: half the attention time).
#if defined(__AVX512VL__)
constexpr int64_t kValueSlices = 4;  // 32 vector registers: 4 heads x 4 slices of accumulators
#else
constexpr int64_t kValueSlices = 2;  // 16 registers
#endif
constexpr int64_t kHeadsAtOnce = 4;

// Values i0 .. i0 + 8S - 1 of a row (i0 a multiple of 8S, 8S dividing 32) as S vectors, to be
// multiplied by the returned factor: a Q8_0 row's codes and their block's scale, which then
// multiplies each position's attention weight once instead of every value.
template <int S, typename T>
inline float load_slices(const T* row, int64_t i0, __m256 out[S]) {  // float32 and float16 rows
  for (int s = 0; s < S; ++s) out[s] = load8(row, i0 + 8 * s);
  return 1.0f;
}
template <int S>
inline float load_slices(const Q8Block* row, int64_t i0, __m256 out[S]) {
  static_assert(32 % (8 * S) == 0, "the slices must lie in one block");
  const Q8Block& block = row[i0 / 32];
  for (int s = 0; s < S; ++s) {
    const int8_t* codes = block.codes + i0 % 32 + 8 * s;
    out[s] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
  }
  return _cvtsh_ss(block.d);
}

template <int H, int S, typename T>
inline void weighted_value_slices(const T* value_cache, const int64_t* offsets, int64_t count, int64_t i0,
                                  const float* const p[], float* const out[]) {
  __m256 acc[H][S];
  for (int h = 0; h < H; ++h) {
    for (int s = 0; s < S; ++s) acc[h][s] = _mm256_setzero_ps();
  }
  for (int64_t t = 0; t < count; ++t) {
    __m256 values[S];
    const float factor = load_slices<S>(value_cache + offsets[t], i0, values);
    for (int h = 0; h < H; ++h) {
      const __m256 weight = _mm256_set1_ps(p[h][t] * factor);
      for (int s = 0; s < S; ++s) acc[h][s] = _mm256_fmadd_ps(weight, values[s], acc[h][s]);
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int s = 0; s < S; ++s) _mm256_storeu_ps(out[h] + i0 + 8 * s, acc[h][s]);
  }
}

template <int H, typename T>
void weighted_values(const T* value_cache, const int64_t* offsets, int64_t count, int64_t head_dim,
                     const float* const p[], float* const out[]) {
  int64_t i0 = 0;
  for (; i0 + 8 * kValueSlices <= head_dim; i0 += 8 * kValueSlices) {
    weighted_value_slices<H, kValueSlices>(value_cache, offsets, count, i0, p, out);
  }
  for (; i0 < head_dim; i0 += 8) weighted_value_slices<H, 1>(value_cache, offsets, count, i0, p, out);
}

// Softmax attention, over one row's (windowed) context, of the query heads that share KV head
// `kv_head` (grouped-query attention): each key and value is read once for all of them. `queries`
// and `out` hold those heads one after another, [group, head_dim]; head_dim is a multiple of 8.
//   - scores: eight keys at a time, each key's partial sums in its own register and one hadd tree
//     for all eight (a horizontal sum per key would be a chain of dependent adds);
//   - output: per 8-wide slice of head_dim, up to four heads accumulate in registers over the whole
//     context, in position order (as out += p_t * v_t would).
// `stats` null: `out` is normalised. Otherwise `out` is left unnormalised and stats[2g], stats[2g + 1]
// get head g's maximum score and sum of exponentials.
template <typename T>
void attend_group(const DecoderShape& s, const DecoderLayerRef& layer, const DecodeBatch& batch,
                  const AttendItem& item, const float* queries, float* out, float* stats) {
  const int64_t group = s.num_heads / s.num_kv_heads, head_dim = s.head_dim;
  const int64_t row = item.row, kv_head = item.kv_head;
  const int64_t start = item.begin;
  const int64_t count = item.end - item.begin;
  // This thread's scratch, used through plain pointers (each access to a thread_local object is a
  // TLS lookup): [group, count] attention weights, each head's maximum, the context's cache offsets.
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> offsets_scratch;
  if (static_cast<int64_t>(scratch.size()) < group * (count + 1)) scratch.resize(group * (count + 1));
  if (static_cast<int64_t>(offsets_scratch.size()) < count) offsets_scratch.resize(count);
  float* scores = scratch.data();
  float* max_scores = scores + group * count;
  int64_t* offsets = offsets_scratch.data();  // of position start + t's head in a layer's cache
  const int64_t row_units = head_dim / kValuesPer<T>, slot_stride = s.num_kv_heads * row_units;
  const T* key_cache = static_cast<const T*>(layer.key_cache);
  const T* value_cache = static_cast<const T*>(layer.value_cache);
  SlotCursor cursor(batch.block_tables + row * batch.table_width, s.block_size, start);
  for (int64_t t = 0; t < count; ++t, cursor.next()) offsets[t] = cursor.slot() * slot_stride + kv_head * row_units;

  const __m256 scale = _mm256_set1_ps(s.attn_scale);
  for (int64_t g = 0; g < group; ++g) max_scores[g] = -std::numeric_limits<float>::infinity();
  const int64_t row_bytes = row_units * static_cast<int64_t>(sizeof(T));
  fetch_piece_into_l2(key_cache, value_cache, offsets, count, row_bytes);
  for (int64_t t = 0; t < std::min<int64_t>(8, count); ++t) prefetch_row(key_cache + offsets[t], row_bytes);
  for (int64_t t0 = 0; t0 < count; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, count - t0);
    const T* keys[8];
    for (int64_t j = 0; j < 8; ++j) keys[j] = key_cache + offsets[t0 + std::min(j, n - 1)];  // pad: repeat
    // The cache rows of a context are scattered over its blocks, too irregular for the hardware
    // prefetcher: without these the attention waited on memory most of its time. Fetch the next
    // eight keys, and these eight positions' values for the weighted sum below, from L2 into L1.
    for (int64_t j = 0; j < 8 && t0 + 8 + j < count; ++j) prefetch_row(key_cache + offsets[t0 + 8 + j], row_bytes);
    for (int64_t j = 0; j < n; ++j) prefetch_row(value_cache + offsets[t0 + j], row_bytes);
    for (int64_t g0 = 0; g0 < group; g0 += kScoreHeads) {
      const int64_t heads = std::min(kScoreHeads, group - g0);
      alignas(32) float block[kScoreHeads][8];
      switch (heads) {
        case 1: score_keys<1>(keys, queries + g0 * head_dim, head_dim, scale, block); break;
        case 2: if constexpr (kScoreHeads > 2) score_keys<2>(keys, queries + g0 * head_dim, head_dim, scale, block); break;
        default: if constexpr (kScoreHeads > 2) score_keys<3>(keys, queries + g0 * head_dim, head_dim, scale, block); break;
      }
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < n; ++j) {
          scores[(g0 + h) * count + t0 + j] = block[h][j];
          max_scores[g0 + h] = std::max(max_scores[g0 + h], block[h][j]);
        }
      }
    }
  }
  float totals[kMaxGroupSize];
  for (int64_t g = 0; g < group; ++g) totals[g] = exp_and_sum(scores + g * count, count, max_scores[g]);

  for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
    const float* weights[kHeadsAtOnce];
    float* outs[kHeadsAtOnce];
    const int64_t heads = std::min(kHeadsAtOnce, group - g0);
    for (int64_t k = 0; k < kHeadsAtOnce; ++k) {
      weights[k] = scores + (g0 + std::min(k, heads - 1)) * count;
      outs[k] = out + (g0 + std::min(k, heads - 1)) * head_dim;
    }
    switch (heads) {
      case 1: weighted_values<1>(value_cache, offsets, count, head_dim, weights, outs); break;
      case 2: weighted_values<2>(value_cache, offsets, count, head_dim, weights, outs); break;
      case 3: weighted_values<3>(value_cache, offsets, count, head_dim, weights, outs); break;
      default: weighted_values<4>(value_cache, offsets, count, head_dim, weights, outs); break;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float total = totals[g];
    if (stats) {
      stats[2 * g] = max_scores[g];
      stats[2 * g + 1] = total;
      continue;
    }
    const float inv_total = 1.0f / total;
    for (int64_t i = 0; i < head_dim; ++i) out[g * head_dim + i] *= inv_total;
  }
}

// Merges the pieces of a split context into `out` ([group, head_dim]):
// out = sum_p e^(m_p - m) acc_p / sum_p e^(m_p - m) l_p, with m the largest piece maximum (each
// piece's own softmax, rescaled to a common one).
void combine_pieces(const DecoderShape& s, const Scratch& m, const SplitContext& split, float* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, head_dim = s.head_dim;
  for (int64_t g = 0; g < group; ++g) {
    const auto stats = [&](int64_t p) { return m.piece_stats.data() + ((split.first_piece + p) * group + g) * 2; };
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < split.num_pieces; ++p) top = std::max(top, stats(p)[0]);
    float total = 0.0f;
    float* o = out + g * head_dim;
    std::fill(o, o + head_dim, 0.0f);
    for (int64_t p = 0; p < split.num_pieces; ++p) {
      const float* acc = m.piece_out.data() + ((split.first_piece + p) * group + g) * head_dim;
      const float weight = std::exp(stats(p)[0] - top);
      total += weight * stats(p)[1];
      for (int64_t i = 0; i < head_dim; ++i) o[i] += weight * acc[i];
    }
    const float inv_total = 1.0f / total;
    for (int64_t i = 0; i < head_dim; ++i) o[i] *= inv_total;
  }
}

// One layer: the element-wise steps on the calling thread, matmuls and attention on the pool. T is the
// KV cache's storage type (float, uint16_t for float16, or Q8Block).
template <typename T>
void run_layer(const DecoderShape& s, const DecoderLayerRef& layer, const DecodeBatch& batch, Scratch& m,
               WorkerPool& pool, int num_threads) {
  const int64_t rows = batch.rows, hidden = s.hidden, inner = s.intermediate;
  const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;

  for (int64_t r = 0; r < rows; ++r) {
    rms_norm(batch.x + r * hidden, layer.input_norm, m.normed.data() + r * hidden, hidden, s.norm_eps);
  }
  m.qkv_in[0].quantize(m.normed.data(), rows, layer.q);
  const QuantizedInput& k_in = input_for(layer.k, m.normed.data(), rows, m.qkv_in[1], layer.q, m.qkv_in[0]);
  const QuantizedInput& v_in = input_for(layer.v, m.normed.data(), rows, m.qkv_in[2], layer.q, m.qkv_in[0]);
  const LinearJob qkv[] = {job(layer.q, m.qkv_in[0], m.q.data()), job(layer.k, k_in, m.k.data()),
                           job(layer.v, v_in, m.v.data())};
  run_linears(qkv, 3, num_threads);

  add_bias(m.q.data(), layer.q.bias, rows, q_size);
  add_bias(m.k.data(), layer.k.bias, rows, kv_size);
  add_bias(m.v.data(), layer.v.bias, rows, kv_size);
  if (layer.q_norm) {  // each head of q and k normed on its own (Qwen 3, Gemma 3)
    for (int64_t h = 0; h < rows * s.num_heads; ++h) {
      float* head = m.q.data() + h * s.head_dim;
      rms_norm(head, layer.q_norm, head, s.head_dim, s.norm_eps);
    }
    for (int64_t h = 0; h < rows * s.num_kv_heads; ++h) {
      float* head = m.k.data() + h * s.head_dim;
      rms_norm(head, layer.k_norm, head, s.head_dim, s.norm_eps);
    }
  }
  const float* cos_table = layer.local_rope ? batch.local_cos : batch.cos;
  const float* sin_table = layer.local_rope ? batch.local_sin : batch.sin;
  for (int64_t r = 0; r < rows; ++r) {
    const float* cos = cos_table + r * s.head_dim;
    const float* sin = sin_table + r * s.head_dim;
    rope(m.q.data() + r * q_size, s.num_heads, s.head_dim, cos, sin);
    rope(m.k.data() + r * kv_size, s.num_kv_heads, s.head_dim, cos, sin);
    write_kv<T>(s, layer, batch.slots[r], m.k.data() + r * kv_size, m.v.data() + r * kv_size);
  }

  // Where the query heads sharing `kv_head` start in q and attn: [rows, num_heads, head_dim].
  const int64_t group = s.num_heads / s.num_kv_heads;
  const auto heads_of = [&](int64_t row, int64_t kv_head) {
    return (row * s.num_heads + kv_head * group) * s.head_dim;
  };
  const AttentionPlan& plan = m.plans[layer.windowed ? 1 : 0];
  pool.run(static_cast<int64_t>(plan.items.size()), num_threads, [&](int64_t index) {
    const AttendItem& item = plan.items[index];
    const float* queries = m.q.data() + heads_of(item.row, item.kv_head);
    if (item.piece < 0) {
      attend_group<T>(s, layer, batch, item, queries, m.attn.data() + heads_of(item.row, item.kv_head), nullptr);
    } else {
      attend_group<T>(s, layer, batch, item, queries, m.piece_out.data() + item.piece * group * s.head_dim,
                      m.piece_stats.data() + item.piece * group * 2);
    }
  });
  for (const SplitContext& split : plan.splits) {
    combine_pieces(s, m, split, m.attn.data() + heads_of(split.row, split.kv_head));
  }

  m.o_in.quantize(m.attn.data(), rows, layer.o);
  const LinearJob o = job(layer.o, m.o_in, m.proj.data());
  run_linears(&o, 1, num_threads);
  add_bias(m.proj.data(), layer.o.bias, rows, hidden);
  add_residual(batch.x, m.proj.data(), layer.attn_out_norm, rows, hidden, s.norm_eps);

  for (int64_t r = 0; r < rows; ++r) {
    rms_norm(batch.x + r * hidden, layer.post_attn_norm, m.normed.data() + r * hidden, hidden, s.norm_eps);
  }
  m.gate_up_in[0].quantize(m.normed.data(), rows, layer.gate);
  const QuantizedInput& up_in = input_for(layer.up, m.normed.data(), rows, m.gate_up_in[1], layer.gate, m.gate_up_in[0]);
  const LinearJob gate_up[] = {job(layer.gate, m.gate_up_in[0], m.gate.data()), job(layer.up, up_in, m.up.data())};
  run_linears(gate_up, 2, num_threads);

  add_bias(m.gate.data(), layer.gate.bias, rows, inner);
  add_bias(m.up.data(), layer.up.bias, rows, inner);
  if (s.activation == Activation::kGeluTanh) {  // written over gate
    gelu_tanh_and_mul(m.gate.data(), m.up.data(), m.gate.data(), rows * inner);
  } else {
    silu_and_mul(m.gate.data(), m.up.data(), m.gate.data(), rows * inner);
  }
  m.down_in.quantize(m.gate.data(), rows, layer.down);
  const LinearJob down = job(layer.down, m.down_in, m.proj.data());
  run_linears(&down, 1, num_threads);
  add_bias(m.proj.data(), layer.down.bias, rows, hidden);
  add_residual(batch.x, m.proj.data(), layer.mlp_out_norm, rows, hidden, s.norm_eps);
}

}  // namespace

void decode_layers(const DecoderShape& shape, const std::vector<DecoderLayerRef>& layers, const DecodeBatch& batch,
                   int num_threads) {
  if (batch.rows == 0) return;
  Scratch scratch(shape, batch);
  WorkerPool& pool = WorkerPool::shared(num_threads);
  for (const DecoderLayerRef& layer : layers) {
    switch (shape.cache) {
      case CacheKind::kFloat16: run_layer<uint16_t>(shape, layer, batch, scratch, pool, num_threads); break;
      case CacheKind::kQ8_0: run_layer<Q8Block>(shape, layer, batch, scratch, pool, num_threads); break;
      default: run_layer<float>(shape, layer, batch, scratch, pool, num_threads); break;
    }
  }
}

}  // namespace rebar_cpu_quant
