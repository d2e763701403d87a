// prefill_attention: a prefill chunk's causal attention over its sequence's cached context and itself, with keys and
// values read from the paged bf16 cache (the chunk's own already written there), on vdpbf16ps.
//
// Flash-attention order: per query head, tiles of kRows queries pass over the keys kKeys at a time with a running
// max and sum per query (online softmax), so no score matrix is kept. Both products run in the outer-product form of
// the packed linear kernel (linear_bf16_vnni.cpp), which needs pairs of the reduced dimension side by side: the
// keys are packed once per call as [key tile][pair of dims][16 keys][2] (scores: a query's dims broadcast against
// 16 keys), the values as [pair of keys][dim][2] (output: a pair of probabilities broadcast against 16 dims). Scores
// and sums are fp32; queries and probabilities are rounded to bf16 for the products, as torch's bf16 flash
// attention rounds them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "linear_bf16_dot.h"
#include "simd.h"
#include "work_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

constexpr int64_t kRows = 12;  // queries in a tile: 12 x 2 score accumulators, 12 x 2 output ones per pass
constexpr int64_t kKeys = 32;  // keys per step: two 16-lane score vectors per query

struct Shapes {
  int64_t chunk, heads, kv_heads, dim, cached, context, padded;  // padded: context rounded up to kKeys
};

// Keys of one KV head into [padded / 16][dim / 2][16][2] and values into [padded / 2][dim][2] (zeros past the
// context), read through the block table.
void pack_head(const c10::BFloat16* keys, const c10::BFloat16* values, const int64_t* table, int64_t block_size,
               const Shapes& s, int64_t kv, uint32_t* packed_keys, uint32_t* packed_values) {
  const int64_t stride = s.kv_heads * s.dim, pairs = s.dim / 2;
  uint32_t* k_out = packed_keys + kv * s.padded * pairs;
  uint16_t* v_out = reinterpret_cast<uint16_t*>(packed_values + kv * s.padded * pairs);
  for (int64_t t = 0; t < s.padded; ++t) {
    uint32_t* k_tile = k_out + (t / 16) * 16 * pairs + (t % 16);
    uint16_t* v_pair = v_out + (t / 2) * 2 * s.dim + (t % 2);
    if (t >= s.context) {
      for (int64_t p = 0; p < pairs; ++p) k_tile[p * 16] = 0;
      for (int64_t d = 0; d < s.dim; ++d) v_pair[2 * d] = 0;
      continue;
    }
    const int64_t row = (table[t / block_size] * block_size + t % block_size) * stride + kv * s.dim;
    const uint32_t* k_row = reinterpret_cast<const uint32_t*>(keys + row);
    const uint16_t* v_row = reinterpret_cast<const uint16_t*>(values + row);
    for (int64_t p = 0; p < pairs; ++p) k_tile[p * 16] = k_row[p];
    for (int64_t d = 0; d < s.dim; ++d) v_pair[2 * d] = v_row[d];
  }
}

inline __m512bh broadcast_pair(const uint32_t* p) { return reinterpret_cast<__m512bh>(_mm512_set1_epi32(*p)); }

// exp of 16 floats: simd.h's exp16 (GCC's vector of 16 floats and __m512 convert by a cast).
inline __m512 exp_ps(__m512 x) { return static_cast<__m512>(exp16(static_cast<Vec16>(x))); }

// One query head's rows q0..q0+rows-1 of the chunk over all the keys they may see.
void query_tile(const float* query, const uint32_t* packed_keys, const uint32_t* packed_values, float* out,
                const Shapes& s, int64_t head, int64_t q0, int64_t rows, float scale) {
  const int64_t pairs = s.dim / 2, kv = head / (s.heads / s.kv_heads);
  const uint32_t* keys = packed_keys + kv * s.padded * pairs;
  const uint32_t* values = packed_values + kv * s.padded * pairs;
  alignas(64) uint32_t q[kRows][128];                    // the queries as bf16 pairs (dim <= 256)
  alignas(64) float acc[kRows][256];                     // output sums
  alignas(64) uint32_t probabilities[kRows][kKeys / 2];  // bf16 pairs of keys
  float row_max[kRows], row_sum[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t i = std::min(q0 + r, s.chunk - 1);  // rows past the chunk repeat its last one (not stored)
    const float* src = query + (i * s.heads + head) * s.dim;
    for (int64_t p = 0; p < pairs; p += 16) {
      const __m512bh two = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 2 * p + 16), _mm512_loadu_ps(src + 2 * p));
      _mm512_store_si512(q[r] + p, reinterpret_cast<__m512i>(two));
    }
    std::fill(acc[r], acc[r] + s.dim, 0.f);
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.f;
  }
  const int64_t last_key = s.cached + q0 + rows - 1;  // the last key any row of the tile sees
  for (int64_t t0 = 0; t0 <= last_key; t0 += kKeys) {
    __m512 score[kRows][2];
    for (int64_t r = 0; r < kRows; ++r) score[r][0] = score[r][1] = _mm512_setzero_ps();
    const uint32_t* k0 = keys + (t0 / 16) * 16 * pairs;
    const uint32_t* k1 = k0 + 16 * pairs;
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k0 + p * 16));
      const __m512bh b = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k1 + p * 16));
      #pragma GCC unroll 12
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512bh x = broadcast_pair(q[r] + p);
        score[r][0] = _mm512_dpbf16_ps(score[r][0], x, a);
        score[r][1] = _mm512_dpbf16_ps(score[r][1], x, b);
      }
    }
    const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(t0)),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i lanes_high = _mm512_add_epi32(lanes, _mm512_set1_epi32(16));
    float alpha[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512i limit = _mm512_set1_epi32(static_cast<int>(s.cached + q0 + r));  // causal: keys <= its position
      const __mmask16 m0 = _mm512_cmple_epi32_mask(lanes, limit), m1 = _mm512_cmple_epi32_mask(lanes_high, limit);
      const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512 s0 = _mm512_mask_mul_ps(minus_inf, m0, score[r][0], _mm512_set1_ps(scale));
      const __m512 s1 = _mm512_mask_mul_ps(minus_inf, m1, score[r][1], _mm512_set1_ps(scale));
      const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      alpha[r] = new_max == -std::numeric_limits<float>::infinity() ? 1.f : std::exp(row_max[r] - new_max);
      row_max[r] = new_max;
      const __m512 e0 = _mm512_maskz_mov_ps(m0, exp_ps(_mm512_sub_ps(s0, _mm512_set1_ps(new_max))));
      const __m512 e1 = _mm512_maskz_mov_ps(m1, exp_ps(_mm512_sub_ps(s1, _mm512_set1_ps(new_max))));
      row_sum[r] = row_sum[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      // keys 2n, 2n+1 side by side: interleave the two halves' bf16 so that pair n holds keys (2n, 2n+1)
      const __m256i low = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e0));
      const __m256i high = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(probabilities[r]), low);
      _mm256_store_si256(reinterpret_cast<__m256i*>(probabilities[r] + 8), high);
    }
    const uint32_t* v = values + (t0 / 2) * s.dim;
    for (int64_t d0 = 0; d0 < s.dim; d0 += 32) {  // 32 dims at a time: 12 x 2 accumulators in registers
      __m512 o[kRows][2];
      #pragma GCC unroll 12
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        o[r][0] = _mm512_mul_ps(_mm512_load_ps(acc[r] + d0), a);
        o[r][1] = _mm512_mul_ps(_mm512_load_ps(acc[r] + d0 + 16), a);
      }
      for (int64_t n = 0; n < kKeys / 2; ++n) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_loadu_si512(v + n * s.dim + d0));
        const __m512bh b = reinterpret_cast<__m512bh>(_mm512_loadu_si512(v + n * s.dim + d0 + 16));
        #pragma GCC unroll 12
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512bh x = broadcast_pair(probabilities[r] + n);
          o[r][0] = _mm512_dpbf16_ps(o[r][0], x, a);
          o[r][1] = _mm512_dpbf16_ps(o[r][1], x, b);
        }
      }
      #pragma GCC unroll 12
      for (int64_t r = 0; r < kRows; ++r) {
        _mm512_store_ps(acc[r] + d0, o[r][0]);
        _mm512_store_ps(acc[r] + d0 + 16, o[r][1]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((q0 + r) * s.heads + head) * s.dim;
    const __m512 inverse = _mm512_set1_ps(1.f / row_sum[r]);
    for (int64_t d = 0; d < s.dim; d += 16)
      _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(acc[r] + d), inverse));
  }
}

}  // namespace

Tensor prefill_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                         const Tensor& block_table, int64_t context_len, double scale) {
  TORCH_CHECK(bf16_dot_supported(), "prefill_attention: needs a CPU with AVX512-BF16");
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "prefill_attention: query [chunk, heads, dim], fp32, contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.scalar_type() == at::kBFloat16 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.is_contiguous(),
              "prefill_attention: caches [blocks, block_size, kv_heads, dim], bf16, contiguous");
  const int64_t chunk = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dim && dim % 32 == 0 && dim <= 256 && heads % kv_heads == 0,
              "prefill_attention: head dim a multiple of 32 up to 256, heads a multiple of the KV heads");
  const Tensor table = block_table.to(at::kLong).contiguous();
  TORCH_CHECK(chunk >= 1 && context_len >= chunk && context_len <= table.numel() * block_size,
              "prefill_attention: context ", context_len, " must cover the chunk (", chunk,
              ") and fit the block table");
  const int64_t padded = (context_len + kKeys - 1) / kKeys * kKeys;
  const Shapes s{chunk, heads, kv_heads, dim, context_len - chunk, context_len, padded};
  // this thread's buffers, kept across calls (a step calls once per layer); pack_head writes every element
  // (the workers get pointers: inside their loop bodies the names would be their own threads' buffers)
  thread_local std::vector<uint32_t> keys_buffer, values_buffer;
  keys_buffer.resize(kv_heads * padded * dim / 2);
  values_buffer.resize(kv_heads * padded * dim / 2);
  uint32_t* packed_keys = keys_buffer.data();
  uint32_t* packed_values = values_buffer.data();
  const auto* keys = key_cache.data_ptr<c10::BFloat16>();
  const auto* values = value_cache.data_ptr<c10::BFloat16>();
  const int64_t* tp = table.data_ptr<int64_t>();
  Tensor out = at::empty_like(query);
  parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kv = begin; kv < end; ++kv)
      pack_head(keys, values, tp, block_size, s, kv, packed_keys, packed_values);
  });
  const int64_t tiles = (chunk + kRows - 1) / kRows;
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t head = item / tiles, q0 = (item % tiles) * kRows;
      query_tile(qp, packed_keys, packed_values, op, s, head, q0, std::min(kRows, chunk - q0),
                 static_cast<float>(scale));
    }
  });
  return out;
}

#pragma GCC pop_options

#else  // not x86-64

Tensor prefill_attention(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double) {
  TORCH_CHECK(false, "prefill_attention: needs a CPU with AVX512-BF16");
}

#endif
