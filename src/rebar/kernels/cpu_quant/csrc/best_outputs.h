// Each row's best output of a linear without writing the outputs (best_outputs.cpp).
#pragma once

#include <cstdint>

#include "elementwise.h"
#include "kernels.h"

namespace rebar_cpu_quant {

// Floats of buffer best_outputs_range needs for `rows` rows.
int64_t best_outputs_buffer_floats(int64_t rows);

// best[r] = the first largest of outputs [tile_begin * 8, tile_end * 8) of row r of x @ w.T (indices
// counted from output 0), computed with linear_tile_range's kernels into `buffer`.
void best_outputs_range(const QuantizedRows& x, const PackedWeights& w, int64_t tile_begin, int64_t tile_end,
                        float* buffer, BestValue* best);

// best[r] = the first largest over chunks' bests ([num_chunks, rows], in output order).
void merge_best_outputs(const BestValue* chunks, int64_t num_chunks, int64_t rows, BestValue* best);

}  // namespace rebar_cpu_quant
