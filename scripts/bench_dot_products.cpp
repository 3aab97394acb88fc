// Peak integer dot-product throughput of one core, register to register (dev tool): AVX-512 VNNI's
// vpdpbusd on 256-bit vectors against AVX2's maddubs + add, 12 independent chains each.
//
//   g++ -O2 -mavx2 -mavx512f -mavx512vl -mavx512vnni -o /tmp/bench_dot_products scripts/bench_dot_products.cpp
//   /tmp/bench_dot_products
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr long kIterations = 200000000;
  constexpr int kChains = 12;
  __m256i a = _mm256_set1_epi8(3);
  const __m256i b = _mm256_set1_epi8(5);

  __m256i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < kIterations; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < kChains; ++k) acc[k] = _mm256_dpbusd_epi32(acc[k], a, b);
    asm volatile("" : "+x"(a));  // keep the loop from being folded
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int check = 0;
  for (int i = 0; i < kChains; ++i) check += _mm256_extract_epi32(acc[i], 0);
  std::printf("vpdpbusd ymm:    %.2f G instructions/s, %.1f G multiply-adds/s (%d)\n",
              kIterations * kChains / seconds / 1e9, kIterations * kChains * 32 / seconds / 1e9, check);

  __m256i sums[kChains];
  for (int i = 0; i < kChains; ++i) sums[i] = _mm256_setzero_si256();
  start = std::chrono::steady_clock::now();
  for (long i = 0; i < kIterations; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < kChains; ++k) sums[k] = _mm256_add_epi16(sums[k], _mm256_maddubs_epi16(a, b));
    asm volatile("" : "+x"(a));
  }
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  check = 0;
  for (int i = 0; i < kChains; ++i) check += _mm256_extract_epi16(sums[i], 0);
  std::printf("maddubs + add:   %.2f G pairs/s, %.1f G multiply-adds/s (%d)\n", kIterations * kChains / seconds / 1e9,
              kIterations * kChains * 32 / seconds / 1e9, check);
  return 0;
}
