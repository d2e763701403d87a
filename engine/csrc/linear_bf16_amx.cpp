// linear with bf16 inputs and weights on AMX tiles (see linear_bf16_amx.h). The weight is packed once, at load, into
// 1 KB blocks in the order the kernel reads them (pack_vnni_weight); x is rounded to bf16 into rows padded to 16.
// Work is split over column blocks of the output (each thread streams its own part of the weight once per step, as
// the streaming kernels do); within one, 2 x 2 tiles (32 rows of x by 32 columns) for long inputs, 1 x 4 tiles for up to 16 rows.
#include "linear_bf16_amx.h"

#include <algorithm>

#include "work_pool.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kRows = 16;        // rows of a tile
constexpr int64_t kPairs = 32;       // bf16 of K per tile row
constexpr int64_t kBlock = 16 * 32;  // bf16 in one packed weight block

bool request_tile_permission() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // linux/arch/x86/include/uapi/asm/prctl.h
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx & (1u << 22)) != 0 && (edx & (1u << 24)) != 0;  // AMX-BF16, AMX-TILE
}

}  // namespace

bool amx_supported() {
  static const bool supported = cpu_has_amx_bf16() && request_tile_permission();
  return supported;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f")

namespace {

// Every tile 16 rows x 64 bytes (palette 1): C tiles 16 x 16 fp32, A tiles 16 x 32 bf16, B tiles 16 pairs x 16.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = kRows;
    }
  }
};

// A C tile's sums into y (rows m0.. of M, columns n0..n0+15), with bias and residual: one 16-float row at a time.
inline void store(int tile_sums_index, float (*sums)[kRows * kRows], const float* bias, const float* residual,
                  float* y, int64_t M, int64_t N, int64_t m0, int64_t n0) {
  const float* s = sums[tile_sums_index];
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t m = m0; m < std::min(M, m0 + kRows); ++m) {
    const int64_t at = m * N + n0;
    __m512 v = _mm512_add_ps(_mm512_load_ps(s + (m - m0) * kRows), b);
    if (residual != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + at));
    _mm512_storeu_ps(y + at, v);
  }
}

constexpr int64_t kPrefetch = 4;  // blocks ahead, per column block's stream

inline void prefetch_block(const c10::BFloat16* block) {
  const char* p = reinterpret_cast<const char*>(block);
  for (int line = 0; line < 16; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T0);
}

// Rows m0..m0+15 of x by column blocks nb0..nb0+NB-1 (NB <= 4): C tiles 0..NB-1, A tile 4, B tiles 5..7.
template <int NB>
void row_block(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
               float* y, int64_t M, int64_t K, int64_t N, int64_t m0, int64_t nb0) {
  const int64_t kbs = K / kPairs;
  const c10::BFloat16* b = packed + nb0 * kbs * kBlock;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < kbs; ++kb) {
    if (kb + kPrefetch < kbs)  // the weight streams from memory: ask for its blocks ahead of the tile loads
      for (int j = 0; j < NB; ++j) prefetch_block(b + (j * kbs + kb + kPrefetch) * kBlock);
    _tile_loadd(4, x + m0 * K + kb * kPairs, K * 2);
    _tile_loadd(5, b + kb * kBlock, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, b + (kbs + kb) * kBlock, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(7, b + (2 * kbs + kb) * kBlock, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NB > 3) {
      _tile_loadd(5, b + (3 * kbs + kb) * kBlock, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float sums[4][kRows * kRows];
  _tile_stored(0, sums[0], 64);
  if constexpr (NB > 1) _tile_stored(1, sums[1], 64);
  if constexpr (NB > 2) _tile_stored(2, sums[2], 64);
  if constexpr (NB > 3) _tile_stored(3, sums[3], 64);
  for (int j = 0; j < NB; ++j) store(j, sums, bias, residual, y, M, N, m0, (nb0 + j) * kRows);
}

// Rows m0..m0+31 by column blocks nb0, nb0+1: C tiles 0..3 (C[i][j] = tile 2i + j), A tiles 4, 5, B tiles 6, 7.
void square_block(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
                  float* y, int64_t M, int64_t K, int64_t N, int64_t m0, int64_t nb0) {
  const int64_t kbs = K / kPairs;
  const c10::BFloat16* b = packed + nb0 * kbs * kBlock;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kbs; ++kb) {
    if (m0 == 0 && kb + kPrefetch < kbs) {  // the first rows stream the weight; later ones find it in L2
      prefetch_block(b + (kb + kPrefetch) * kBlock);
      prefetch_block(b + (kbs + kb + kPrefetch) * kBlock);
    }
    _tile_loadd(4, x + m0 * K + kb * kPairs, K * 2);
    _tile_loadd(6, b + kb * kBlock, 64);
    _tile_loadd(5, x + (m0 + kRows) * K + kb * kPairs, K * 2);
    _tile_loadd(7, b + (kbs + kb) * kBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sums[4][kRows * kRows];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) store(2 * i + j, sums, bias, residual, y, M, N, m0 + i * kRows, (nb0 + j) * kRows);
}

// Column blocks nb0..nb0+NB-1 for all rows of x.
template <int NB>
void column_group(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
                  float* y, int64_t M, int64_t K, int64_t N, int64_t nb0) {
  const int64_t padded = (M + kRows - 1) / kRows * kRows;  // x's rows
  int64_t m0 = 0;
  if constexpr (NB % 2 == 0)
    if (M > kRows)
      for (; m0 + 2 * kRows <= padded; m0 += 2 * kRows)
        for (int j = 0; j < NB; j += 2) square_block(x, packed, bias, residual, y, M, K, N, m0, nb0 + j);
  for (; m0 < padded; m0 += kRows) row_block<NB>(x, packed, bias, residual, y, M, K, N, m0, nb0);
}

}  // namespace

void amx_linear(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
                float* y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kGroup = 4;  // column blocks the kernels take at once: 64 output columns
  // The range split over threads is the column blocks themselves, not groups of four: 576 columns are 9 groups,
  // which two threads' chunks would share 6:3, but 36 blocks, which they share 18:18.
  parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config;
    _tile_loadconfig(&config);
    for (int64_t nb0 = begin; nb0 < end; nb0 += kGroup) {
      switch (std::min(kGroup, end - nb0)) {
        case 4: column_group<4>(x, packed, bias, residual, y, M, K, N, nb0); break;
        case 3: column_group<3>(x, packed, bias, residual, y, M, K, N, nb0); break;
        case 2: column_group<2>(x, packed, bias, residual, y, M, K, N, nb0); break;
        default: column_group<1>(x, packed, bias, residual, y, M, K, N, nb0); break;
      }
    }
    _tile_release();
  });
}

#pragma GCC pop_options

#else  // not x86-64: no AMX

bool amx_supported() { return false; }

void amx_linear(const c10::BFloat16*, const c10::BFloat16*, const float*, const float*, float*, int64_t, int64_t,
                int64_t) {}

#endif
