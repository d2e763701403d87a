// linear with bf16 inputs and a bf16 weight in the packed layout on vdpbf16ps (see linear_bf16_vnni.h): up to 4 rows
// of x one column block at a time (stream_block), register tiles above. A register tile is MR rows of x by NB column
// blocks of 16: MR x NB fp32 accumulators; per pair of K, NB weight rows (64 bytes each, one per block) and MR broadcast pairs of x feed MR x NB vdpbf16ps. Work is split over column
// blocks (each thread streams its own part of the weight once per call, as the other kernels do); within a group of
// NB blocks every row tile passes over the group's weight panel, which stays in L2 after the first.
#include "linear_bf16_vnni.h"

#include <algorithm>

#include "work_pool.h"

at::Tensor pack_vnni_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_vnni_weight: a 2-d bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "pack_vnni_weight: [N, K] with N % 16 == 0 and K % 32 == 0, got [", N,
              ", ", K, "]");
  // [N/16, K/2, 16, 2] -> [N/16, K/32, 16, 32]: block (nb, kb) row r = the pairs of K 32 kb + 2r for its 16 columns
  return weight.contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view(
      {N / 16, K / 32, 16, 32});
}

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

namespace {

constexpr int64_t kCols = 16;              // output columns of a block
constexpr int64_t kPairs = 16;             // pairs of K in one packed block (32 values)
constexpr int64_t kBlock = kCols * 32;     // bf16 in one packed block
// 6 x 4 accumulators (of 32 registers): per pair of K 4 weight loads and 6 broadcasts for 24 vdpbf16ps, which run
// at one per cycle on a Zen 5 core (measured: 8 x 3 and 4 x 6 were as fast, 12 x 2 slower; BENCHMARKS.md).
constexpr int kMaxRows = 6;             // rows of x in a register tile
constexpr int kGroup = 4;               // column blocks in a register tile
constexpr int64_t kPrefetchBlocks = 4;  // blocks ahead in each block's stream, while the first rows run

inline __m512bh pair_of(const c10::BFloat16* p) {
  int32_t bits;
  __builtin_memcpy(&bits, p, sizeof bits);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// Rows m0..m0+MR-1 of y by column blocks nb0..nb0+NB-1.
template <int MR, int NB>
__attribute__((always_inline)) inline void tile(const c10::BFloat16* x, const c10::BFloat16* packed,
                                                const float* bias, const float* residual, float* y, int64_t K,
                                                int64_t N, int64_t m0, int64_t nb0, bool stream) {
  const int64_t kbs = K / (2 * kPairs);
  const c10::BFloat16* w = packed + nb0 * kbs * kBlock;
  __m512 acc[MR][NB];
  #pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < kbs; ++kb) {
    if (stream && kb + kPrefetchBlocks < kbs)  // the first row tile reads the weight from memory
      #pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        for (int line = 0; line < 16; line += 2)  // a block is 16 lines; the adjacent-line prefetcher takes pairs
          __builtin_prefetch(w + (j * kbs + kb + kPrefetchBlocks) * kBlock + line * 32, 0, 3);
    const c10::BFloat16* xk = x + m0 * K + kb * 2 * kPairs;
    #pragma GCC unroll 2
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512bh wv[NB];
      #pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + (j * kbs + kb) * kBlock + p * 32));
      #pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = pair_of(xk + m * K + 2 * p);
        #pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (nb0 + j) * kCols;
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    #pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * N + n0;
      __m512 v = _mm512_add_ps(acc[m][j], b);
      if (residual != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + at));
      _mm512_storeu_ps(y + at, v);
    }
  }
}

// Rows 0..MR-1 of y by column block nb, for decode-sized inputs: a thread's blocks follow each other in memory, so
// its part of the weight is one sequential stream, which the hardware prefetchers follow at the memory's bandwidth
// (over weights larger than the caches as fast as the dot kernel's rows or faster, 1-4 rows: BENCHMARKS.md); U
// accumulators per row over alternating pairs of K hide the vdpbf16ps latency.
template <int MR, int U>
__attribute__((always_inline)) inline void stream_block(const c10::BFloat16* x, const c10::BFloat16* packed,
                                                        const float* bias, const float* residual, float* y,
                                                        int64_t K, int64_t N, int64_t nb) {
  const c10::BFloat16* w = packed + nb * K * kCols;
  __m512 acc[MR][U];
  #pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; p += U) {  // K / 2 is a multiple of 16
    #pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + (p + u) * 32));
      #pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], pair_of(x + m * K + 2 * (p + u)), wv);
    }
  }
  const int64_t n0 = nb * kCols;
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  #pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    __m512 v = b;
    #pragma GCC unroll 8
    for (int u = 0; u < U; ++u) v = _mm512_add_ps(v, acc[m][u]);
    if (residual != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + m * N + n0));
    _mm512_storeu_ps(y + m * N + n0, v);
  }
}

template <int MR, int U>
void stream(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual, float* y,
            int64_t K, int64_t N) {
  parallel_for(0, N / kCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) stream_block<MR, U>(x, packed, bias, residual, y, K, N, nb);
  });
}

// The last rows (fewer than kMaxRows) of a column group: tile<rows, NB>.
template <int NB, int MR>
inline void tail(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
                 float* y, int64_t rows, int64_t K, int64_t N, int64_t m0, int64_t nb0, bool stream) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, NB>(x, packed, bias, residual, y, K, N, m0, nb0, stream);
    tail<NB, MR - 1>(x, packed, bias, residual, y, rows, K, N, m0, nb0, stream);
  }
}

// Column blocks nb0..nb0+NB-1 for all M rows of x: row tiles of kMaxRows, the last one of the rows left.
template <int NB>
void column_group(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
                  float* y, int64_t M, int64_t K, int64_t N, int64_t nb0) {
  int64_t m0 = 0;
  for (; m0 + kMaxRows <= M; m0 += kMaxRows) tile<kMaxRows, NB>(x, packed, bias, residual, y, K, N, m0, nb0, m0 == 0);
  if (m0 < M) tail<NB, kMaxRows - 1>(x, packed, bias, residual, y, M - m0, K, N, m0, nb0, m0 == 0);
}

}  // namespace

void vnni_linear(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
                 float* y, int64_t M, int64_t K, int64_t N) {
  switch (M) {
    case 1: return stream<1, 4>(x, packed, bias, residual, y, K, N);
    case 2: return stream<2, 4>(x, packed, bias, residual, y, K, N);
    case 3: return stream<3, 4>(x, packed, bias, residual, y, K, N);
    case 4: return stream<4, 4>(x, packed, bias, residual, y, K, N);
    default: break;
  }
  // split over column blocks, not groups: 36 blocks (576 columns) share 18:18 between two threads, 9 groups 6:3
  parallel_for(0, N / kCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb0 = begin; nb0 < end; nb0 += kGroup) {
      switch (std::min<int64_t>(kGroup, end - nb0)) {
        case 4: column_group<4>(x, packed, bias, residual, y, M, K, N, nb0); break;
        case 3: column_group<3>(x, packed, bias, residual, y, M, K, N, nb0); break;
        case 2: column_group<2>(x, packed, bias, residual, y, M, K, N, nb0); break;
        default: column_group<1>(x, packed, bias, residual, y, M, K, N, nb0); break;
      }
    }
  });
}

#pragma GCC pop_options

#else  // not x86-64: no vdpbf16ps; weights are not packed there

void vnni_linear(const c10::BFloat16*, const c10::BFloat16*, const float*, const float*, float*, int64_t, int64_t,
                 int64_t) {}

#endif
