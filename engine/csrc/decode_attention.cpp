// decode_attention: one query token per sequence against its keys and values in the paged KV cache.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "work_pool.h"

// ---- decode attention straight from the paged cache ------------------------------------------------------------
// One query token per sequence against its cached keys and values, read in place through the block table (no
// gathered copy of the context, which grows with context length and batch). A task is one sequence's query heads
// over one slice of its context, 16 tokens at a time: the 16 dot products of a query head are summed across their
// lanes together (a transposing tree, ~3 instructions per token instead of ~9), and the query heads that share a
// KV head (grouped-query attention) read its rows from L1. A short batch splits each context into slices so that
// both threads have work (batch 1 would be one task), and the slices' partial results are merged after.

constexpr int64_t kTokenGroup = 16;
// Zeros that stand in for the missing rows of a last, partial group (T: the cache's element, float or bf16).
template <typename T>
static const T* zero_row() {
  alignas(64) static const T zeros[256] = {};
  return zeros;
}

// rows[i] = the cache row of token t0 + i (i < count), through the block table; `stride` elements per token.
template <typename T>
static inline void token_rows(const T* cache, const int64_t* table, int64_t t0, int64_t count,
                              int64_t block_size, int64_t stride, const T** rows) {
  int64_t b = t0 / block_size, i = t0 - b * block_size;
  for (int64_t t = 0; t < count; ++t) {
    rows[t] = cache + (table[b] * block_size + i) * stride;
    if (++i == block_size) i = 0, ++b;
  }
}

// Lane i of the result: the sum of the 16 lanes of v[i].
static inline Vec16 transpose_sum16(Vec16 (&v)[16]) {
  Vec16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: token 2i's halves added, 8-15: token 2i+1's
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  for (int i = 0; i < 4; ++i)  // four lanes per token
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // two lanes per token
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// scores[i] = scale * q . rows[i][offset..] for a group of 16 tokens (head size 16 * DV; rows past `count` read
// zeros). Writes all 16 scores.
template <int DV, typename T>
static inline void score_group(const float* q, const T* const* rows, int64_t offset, int64_t count, float scale,
                               float* scores) {
  const T* r[kTokenGroup];
  for (int64_t i = 0; i < kTokenGroup; ++i) r[i] = i < count ? rows[i] + offset : zero_row<T>();
  Vec16 acc[kTokenGroup] = {};
  for (int v = 0; v < DV; ++v) {
    const Vec16 qv = load16(q + 16 * v);
#pragma GCC unroll 16
    for (int64_t i = 0; i < kTokenGroup; ++i) acc[i] += qv * load16(r[i] + 16 * v);
  }
  const Vec16 s = transpose_sum16(acc) * scale;
  std::memcpy(scores, &s, sizeof s);
}

// out_h += sum_i weights[h][i] * rows[i][offset..] for H query heads (head size 16 * DV) and `count` tokens.
template <int DV, int H, typename T>
static inline void accumulate_group(const float* weights, int64_t weight_stride, const T* const* rows,
                                    int64_t offset, int64_t count, float* out) {
  Vec16 acc[H][DV];
  for (int h = 0; h < H; ++h)
    for (int v = 0; v < DV; ++v) acc[h][v] = load16(out + h * 16 * DV + 16 * v);
  for (int64_t i = 0; i < count; ++i) {
    Vec16 val[DV];
    for (int v = 0; v < DV; ++v) val[v] = load16(rows[i] + offset + 16 * v);
    for (int h = 0; h < H; ++h) {
      const float w = weights[h * weight_stride + i];
      for (int v = 0; v < DV; ++v) acc[h][v] += w * val[v];
    }
  }
  for (int h = 0; h < H; ++h) std::memcpy(out + h * 16 * DV, acc[h], sizeof acc[h]);
}

// A slice's partial softmax for one query head: its largest score, the sum of exp(score - max) and the
// exp-weighted sum of the values (divided by the total sum once all slices are merged).
struct Partial {
  float max_score = -INFINITY;
  float exp_sum = 0.f;
};

// Turns a head's n scores into exp(score - max) in place (lanes past n: 0) and returns the partial softmax.
static inline Partial softmax_weights(float* scores, int64_t n) {
  float max_score = -INFINITY;
  for (int64_t t = 0; t < n; ++t) max_score = std::max(max_score, scores[t]);
  const VecI16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Vec16 sum = Vec16{};
  for (int64_t t = 0; t < n; t += 16) {
    Vec16 e = exp16(load16(scores + t) - max_score);
    e = lane < static_cast<int32_t>(n - t) ? e : Vec16{};
    std::memcpy(scores + t, &e, sizeof e);
    sum += e;
  }
  return {max_score, sum16(sum)};
}

// One slice's two passes over its tokens, 16 at a time through the block table: score(rows, offset, count) writes
// the heads' scores of tokens offset.. (scores: heads rows of `width` >= the slice rounded up to 16 floats), which
// then become softmax weights (partials: [heads]); accumulate(rows, offset, count) adds the weighted values into
// outputs ([heads, dim], unnormalized).
template <typename T, typename Score, typename Accumulate>
static inline void attend_slice_passes(const T* key_cache, const T* value_cache, const int64_t* table,
                                       int64_t first, int64_t last, int64_t block_size, int64_t stride,
                                       int64_t heads, int64_t dim, float* scores, int64_t width, Partial* partials,
                                       float* outputs, const Score& score, const Accumulate& accumulate) {
  const T* rows[kTokenGroup];
  for (int64_t t0 = first; t0 < last; t0 += kTokenGroup) {
    const int64_t count = std::min(kTokenGroup, last - t0);
    token_rows(key_cache, table, t0, count, block_size, stride, rows);
    score(rows, t0 - first, count);
  }
  for (int64_t h = 0; h < heads; ++h) partials[h] = softmax_weights(scores + h * width, last - first);
  std::fill(outputs, outputs + heads * dim, 0.f);
  for (int64_t t0 = first; t0 < last; t0 += kTokenGroup) {
    const int64_t count = std::min(kTokenGroup, last - t0);
    token_rows(value_cache, table, t0, count, block_size, stride, rows);
    accumulate(rows, t0 - first, count);
  }
}

// All query heads of one sequence over its tokens first..last-1, for a head size of 16 * DV.
template <int DV, typename T>
static void attend_slice(const float* q, const T* key_cache, const T* value_cache, const int64_t* table,
                         int64_t first, int64_t last, int64_t block_size, int64_t heads, int64_t kv_heads,
                         float scale, float* scores, int64_t width, Partial* partials, float* outputs) {
  constexpr int64_t dim = 16 * DV;
  constexpr int64_t kMaxHeads = std::max(1, 16 / DV);  // running sums of at most 16 registers
  const int64_t group = heads / kv_heads;
  const auto score = [&](const T* const* rows, int64_t offset, int64_t count) {
    for (int64_t h = 0; h < heads; ++h)
      score_group<DV>(q + h * dim, rows, h / group * dim, count, scale, scores + h * width + offset);
  };
  const auto accumulate = [&](const T* const* rows, int64_t offset, int64_t count) {
    for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head)
      for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h += kMaxHeads) {
        const float* w = scores + h * width + offset;
        float* o = outputs + h * dim;
        switch (std::min(kMaxHeads, (kv_head + 1) * group - h)) {
          case 1: accumulate_group<DV, 1>(w, width, rows, kv_head * dim, count, o); break;
          case 2: accumulate_group<DV, 2>(w, width, rows, kv_head * dim, count, o); break;
          case 3: accumulate_group<DV, std::min<int>(3, kMaxHeads)>(w, width, rows, kv_head * dim, count, o); break;
          default: accumulate_group<DV, std::min<int>(4, kMaxHeads)>(w, width, rows, kv_head * dim, count, o); break;
        }
      }
  };
  attend_slice_passes(key_cache, value_cache, table, first, last, block_size, kv_heads * dim, heads, dim, scores,
                      width, partials, outputs, score, accumulate);
}

// The same for any head size (scalar loops; no model this engine serves by default has one).
template <typename T>
static void attend_slice_any(const float* q, const T* key_cache, const T* value_cache, const int64_t* table,
                             int64_t first, int64_t last, int64_t block_size, int64_t heads, int64_t kv_heads,
                             int64_t dim, float scale, float* scores, int64_t width, Partial* partials,
                             float* outputs) {
  const int64_t group = heads / kv_heads;
  const auto score = [&](const T* const* rows, int64_t offset, int64_t count) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < count; ++i)
        scores[h * width + offset + i] = dot(q + h * dim, rows[i] + h / group * dim, dim) * scale;
  };
  const auto accumulate = [&](const T* const* rows, int64_t offset, int64_t count) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < count; ++i) {
        const float w = scores[h * width + offset + i];
        const T* v = rows[i] + h / group * dim;
        for (int64_t d = 0; d < dim; ++d) outputs[h * dim + d] += w * static_cast<float>(v[d]);
      }
  };
  attend_slice_passes(key_cache, value_cache, table, first, last, block_size, kv_heads * dim, heads, dim, scores,
                      width, partials, outputs, score, accumulate);
}

// query [seqs, heads, dim]; caches [blocks, block_size, kv_heads, dim]; block_tables [seqs, >= ceil(context /
// block_size)]; context_lens [seqs]. Returns [seqs, heads, dim]. An fp32 query; fp32 or bf16 caches (widened to
// fp32 as they are read; all sums in fp32).
Tensor decode_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                        const Tensor& block_tables, const Tensor& context_lens, double scale) {
  const bool bf16 = key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(query.scalar_type() == at::kFloat && (bf16 || key_cache.scalar_type() == at::kFloat) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "decode_attention: an fp32 query and fp32 or bf16 caches only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "decode_attention: contiguous caches only");
  TORCH_CHECK(query.is_cpu() && key_cache.is_cpu() && value_cache.is_cpu(), "decode_attention: CPU tensors only");
  const Tensor q = query.contiguous();
  const Tensor tables = block_tables.to(at::kLong).contiguous();
  const Tensor lens = context_lens.to(at::kLong).contiguous();
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t table_width = tables.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && key_cache.size(3) == dim, "decode_attention: head shapes do not match");
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(len_ptr[s] >= 1 && len_ptr[s] <= table_width * block_size,
                "decode_attention: context length ", len_ptr[s], " outside the block table");
    longest = std::max(longest, len_ptr[s]);
  }
  // Slices per context: enough tasks for every thread a few times over, none shorter than kMinSliceTokens.
  constexpr int64_t kMinSliceTokens = 32, kTasksPerThread = 4;
  const int64_t wanted = kTasksPerThread * at::get_num_threads();
  const int64_t slices = std::clamp<int64_t>((wanted + seqs - 1) / seqs, 1,
                                             std::max<int64_t>(1, longest / kMinSliceTokens));
  const int64_t slice_tokens = (longest + slices - 1) / slices, width = (slice_tokens + 15) / 16 * 16;
  Tensor out = at::empty_like(q);
  float* op = out.data_ptr<float>();
  // per (slice, sequence, head): the partial softmax and the unnormalized output, merged below (one slice writes
  // its outputs straight into `out`)
  std::vector<Partial> partials(slices * seqs * heads);
  std::vector<float> slice_outputs(slices > 1 ? slices * seqs * heads * dim : 0);
  float* unnormalized = slices > 1 ? slice_outputs.data() : op;
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  // the tasks, on the cache's element type
  const auto attend = [&](const auto* kp, const auto* vp) {
    parallel_for(0, seqs * slices, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores;
      scores.resize(heads * width);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t slice = task % slices, s = task / slices;
        const int64_t first = slice * slice_tokens, last = std::min(len_ptr[s], first + slice_tokens);
        const int64_t at = slice * seqs * heads + s * heads;
        if (first >= last) {  // a short context in a batch split for a longer one
          std::fill(partials.begin() + at, partials.begin() + at + heads, Partial{});
          continue;
        }
        const float sc = static_cast<float>(scale);
        const int64_t* table = tp + s * table_width;
        float* o = unnormalized + at * dim;
        switch (dim) {
          case 64: attend_slice<4>(qp + s * heads * dim, kp, vp, table, first, last, block_size, heads, kv_heads, sc,
                                   scores.data(), width, partials.data() + at, o); break;
          case 128: attend_slice<8>(qp + s * heads * dim, kp, vp, table, first, last, block_size, heads, kv_heads, sc,
                                    scores.data(), width, partials.data() + at, o); break;
          default: attend_slice_any(qp + s * heads * dim, kp, vp, table, first, last, block_size, heads, kv_heads, dim,
                                    sc, scores.data(), width, partials.data() + at, o); break;
        }
      }
    });
  };
  if (bf16)
    attend(key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>());
  else
    attend(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  // Merge the slices: out = sum_i exp(m_i - m) o_i / sum_i exp(m_i - m) l_i, m the largest m_i.
  for (int64_t head = 0; head < seqs * heads; ++head) {
    float* dst = op + head * dim;
    if (slices == 1) {
      const float inverse = 1.f / partials[head].exp_sum;
      for (int64_t d = 0; d < dim; ++d) dst[d] *= inverse;
      continue;
    }
    float max_score = -INFINITY;
    for (int64_t i = 0; i < slices; ++i) max_score = std::max(max_score, partials[i * seqs * heads + head].max_score);
    float total = 0.f;
    std::fill(dst, dst + dim, 0.f);
    for (int64_t i = 0; i < slices; ++i) {
      const Partial& part = partials[i * seqs * heads + head];
      if (part.exp_sum == 0.f) continue;  // an empty slice
      const float weight = std::exp(part.max_score - max_score);
      total += weight * part.exp_sum;
      const float* src = slice_outputs.data() + (i * seqs * heads + head) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += weight * src[d];
    }
    const float inverse = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) dst[d] *= inverse;
  }
  return out;
}
