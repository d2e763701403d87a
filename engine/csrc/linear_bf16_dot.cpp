// linear with bf16 inputs and weights on vdpbf16ps (see linear_bf16_dot.h). The same shapes as the fp32 kernels in
// linear.cpp: a weight row streamed once for all rows of x up to 6 rows, tiles of 3 rows x 8 weight rows above;
// 32 bf16 per instruction, fp32 sums; a tail of K (not a multiple of 32) is read with masked loads (zeros). The
// loops over rows and accumulators are unrolled by pragma: only with constant indices does GCC keep the
// accumulators in registers (it kept them in a stack array, a store after every vdpbf16ps: 1.3-2x slower).
#include "linear_bf16_dot.h"

#include <algorithm>

#include "work_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>

bool bf16_dot_supported() {
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

namespace {

inline __m512bh load32(const c10::BFloat16* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// Weights are read once per call, from memory: from 3 rows of x a software prefetch keeps enough of them in flight
// (measured on an AMD EPYC VM: BENCHMARKS.md, "bf16 matrix kernels"). __builtin_prefetch, not _mm_prefetch: under
// this file's target pragma GCC emitted no instruction for the latter.
constexpr int64_t kPrefetchAhead = 1024;  // bf16 values ahead in the weight stream (2 KB)

inline void prefetch_weights(const c10::BFloat16* p) { __builtin_prefetch(p, 0, 3); }

inline __mmask32 tail_mask(int64_t left) { return left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1; }

inline float finish(float sum, const float* bias, const float* residual, int64_t n, int64_t at) {
  if (bias != nullptr) sum += bias[n];
  return residual != nullptr ? residual[at] + sum : sum;
}

// Output column n for M rows of x, U independent accumulators per row (as gemv_column in linear.cpp).
template <int M, int U>
__attribute__((always_inline)) inline void gemv_column(const c10::BFloat16* x, const c10::BFloat16* w,
                                                       const float* bias, const float* residual, float* y, int64_t K,
                                                       int64_t N, int64_t n) {
  const c10::BFloat16* row = w + n * K;
  __m512 acc[M][U];
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
    #pragma GCC unroll 16
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U) {
    __m512bh wv[U];
    #pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      wv[u] = load32(row + k + 32 * u, ~__mmask32{0});
      // from 3 rows (at 1-2 the hardware prefetcher keeps up, and the extra loads slowed it 1.2-1.4x)
      if constexpr (M >= 3) prefetch_weights(row + k + 32 * u + kPrefetchAhead);
    }
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
      #pragma GCC unroll 16
      for (int u = 0; u < U; ++u)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], load32(x + m * K + k + 32 * u, ~__mmask32{0}), wv[u]);
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = tail_mask(K - k);
    const __m512bh wv = load32(row + k, mask);
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], load32(x + m * K + k, mask), wv);
  }
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    __m512 total = acc[m][0];
    #pragma GCC unroll 16
    for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[m][u]);
    y[m * N + n] = finish(_mm512_reduce_add_ps(total), bias, residual, n, m * N + n);
  }
}

template <int M, int U>
void gemv(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, const float* residual, float* y,
          int64_t K, int64_t N) {
  parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) gemv_column<M, U>(x, w, bias, residual, y, K, N, n);
  });
}

// Rows m0..m0+MR of y, columns n0..n0+NR (as linear_tile in linear.cpp).
template <int MR, int NR, bool Prefetch = false>
__attribute__((always_inline)) inline void tile(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias,
                                                const float* residual, float* y, int64_t K, int64_t N, int64_t m0,
                                                int64_t n0) {
  __m512 acc[MR][NR];
  #pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = tail_mask(K - k);
    __m512bh wv[NR];
    #pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      wv[r] = load32(w + (n0 + r) * K + k, mask);
      if constexpr (Prefetch) prefetch_weights(w + (n0 + NR + r) * K + k);  // the next column block's rows
    }
    #pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = load32(x + (m0 + m) * K + k, mask);
      #pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r, at = (m0 + m) * N + n;
      y[at] = finish(_mm512_reduce_add_ps(acc[m][r]), bias, residual, n, at);
    }
}

template <int NR>
void columns(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, const float* residual, float* y,
             int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m0 = 0;
  if (M >= 3) {
    tile<3, NR, true>(x, w, bias, residual, y, K, N, 0, n0);
    m0 = 3;
  }
  for (; m0 + 3 <= M; m0 += 3) tile<3, NR>(x, w, bias, residual, y, K, N, m0, n0);
  if (M - m0 == 2) tile<2, NR>(x, w, bias, residual, y, K, N, m0, n0);
  if (M - m0 == 1) tile<1, NR>(x, w, bias, residual, y, K, N, m0, n0);
}

void tiled(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, const float* residual, float* y,
           int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kTile = 8;
  const int64_t tiles = N / kTile;
  parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) columns<kTile>(x, w, bias, residual, y, M, K, N, t * kTile);
  });
  for (int64_t n = tiles * kTile; n < N; ++n) columns<1>(x, w, bias, residual, y, M, K, N, n);
}

}  // namespace

void bf16_dot_linear(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, const float* residual,
                     float* y, int64_t M, int64_t K, int64_t N) {
  switch (M) {
    case 1: gemv<1, 4>(x, w, bias, residual, y, K, N); break;
    case 2: gemv<2, 4>(x, w, bias, residual, y, K, N); break;
    case 3: gemv<3, 2>(x, w, bias, residual, y, K, N); break;
    case 4: gemv<4, 2>(x, w, bias, residual, y, K, N); break;
    case 5: gemv<5, 1>(x, w, bias, residual, y, K, N); break;
    case 6: gemv<6, 1>(x, w, bias, residual, y, K, N); break;
    default: tiled(x, w, bias, residual, y, M, K, N); break;
  }
}

#pragma GCC pop_options

#else  // not x86-64: no vdpbf16ps; linear.cpp widens the weights instead

bool bf16_dot_supported() { return false; }

void bf16_dot_linear(const c10::BFloat16*, const c10::BFloat16*, const float*, const float*, float*, int64_t,
                     int64_t, int64_t) {}

#endif
