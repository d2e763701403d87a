// The engine's CPU kernels (fp32): the decoder's layer loop for one step (decode groups and prefill chunks) in C++,
// the same ops in the same order as engine/model.py (LlamaModel.forward) and engine/attention.py (paged_attention),
// so the two loops are bit-identical, without ~1,700 Python -> ATen calls per step; and the kernels both loops use:
// small-batch linear, decode attention over the paged cache, RMS norm, rotary + KV write, SiLU*up. Built once by
// engine/fused_layers.py (-O3 -march=native).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

using at::Tensor;

// ---- threads: a work pool whose caller never waits for a thread that has not started -----------------------------
// ATen's parallel_for (OpenMP fork-join) ends each region at a barrier that every thread must reach. When another
// process holds one of the cores (the load generator beside the engine, a test run), each of a step's ~150 regions
// waits for the descheduled thread's next time slice: measured 2-15x slower than one thread alone. Here the caller
// claims chunks alongside the workers and waits only for chunks a worker has claimed; a worker that wakes late
// finds nothing left. So a step runs at two threads' speed when both cores are free and at one thread's when not.
// The loop bodies given to it must not throw (they validate their input before the loop).
class WorkPool {
 public:
  static WorkPool& instance() {
    static WorkPool* pool = new WorkPool();  // never destroyed: its threads sleep until the process exits
    return *pool;
  }

  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t threads = at::get_num_threads();
    std::unique_lock<std::mutex> one_region_at_a_time(caller_, std::try_to_lock);
    if (threads <= 1 || n <= grain || !one_region_at_a_time.owns_lock()) {
      body(begin, end);
      return;
    }
    grow(threads - 1);
    // two chunks per thread: a late thread's share is picked up by the others (more, smaller chunks, or guided
    // ones shrinking towards the end, measured no faster: each claim is a contended atomic)
    const int64_t chunk = std::max({grain, (n + 2 * threads - 1) / (2 * threads), (n + kMaxChunks - 1) / kMaxChunks});
    const uint64_t chunks = static_cast<uint64_t>((n + chunk - 1) / chunk);
    const std::function<void(int64_t, int64_t)> task = [&](int64_t b, int64_t e) { body(b, e); };
    task_ = &task;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t epoch = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(epoch << 32 | chunks << 16, std::memory_order_seq_cst);  // publishes the fields above
    if (sleeping_.load(std::memory_order_seq_cst) > 0) state_.notify_all();  // seq_cst pairs with work()'s check
    while (run_chunk(static_cast<uint32_t>(epoch))) {
    }
    while (done_.load(std::memory_order_acquire) < chunks) spin_pause();  // chunks a worker claimed
  }

 private:
  // state_: the region's number (high 32 bits), its chunk count (bits 16-31) and the next unclaimed chunk (0-15)
  static constexpr int64_t kMaxChunks = 1 << 15;

  static void spin_pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Claims the next chunk of region `epoch` and runs it; false when the region has none left (or is over).
  bool run_chunk(uint32_t epoch) {
    uint64_t s = state_.load(std::memory_order_acquire);
    do {
      if ((s >> 32) != epoch || (s & 0xffff) >= ((s >> 16) & 0xffff)) return false;
    } while (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire));
    // a claimed chunk keeps the caller inside parallel_for, so the region's fields stay valid until done_ counts it
    const int64_t b = begin_ + static_cast<int64_t>(s & 0xffff) * chunk_;
    (*task_)(b, std::min(end_, b + chunk_));
    done_.fetch_add(1, std::memory_order_release);
    return true;
  }

  void grow(int64_t workers) {
    while (static_cast<int64_t>(threads_) < workers) {
      std::thread(&WorkPool::work, this).detach();
      ++threads_;
    }
  }

  void work() {
    uint32_t seen = static_cast<uint32_t>(state_.load(std::memory_order_acquire) >> 32);
    while (true) {
      uint64_t s = state_.load(std::memory_order_acquire);
      // spin for a while (a step's regions follow each other within microseconds), then sleep until notified
      for (int i = 0; static_cast<uint32_t>(s >> 32) == seen; ++i) {
        if (i < kSpins) {
          spin_pause();
        } else {
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          if (static_cast<uint32_t>(state_.load(std::memory_order_seq_cst) >> 32) == seen) state_.wait(s);
          sleeping_.fetch_sub(1, std::memory_order_seq_cst);
          i = 0;
        }
        s = state_.load(std::memory_order_acquire);
      }
      seen = static_cast<uint32_t>(s >> 32);
      while (run_chunk(seen)) {
      }
    }
  }

  static constexpr int kSpins = 1 << 14;  // ~100-300 us of pause instructions
  std::atomic<uint64_t> state_{0};
  std::atomic<uint64_t> done_{0};
  std::atomic<int> sleeping_{0};
  const std::function<void(int64_t, int64_t)>* task_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  size_t threads_ = 0;  // only the caller holding caller_ starts threads
  std::mutex caller_;
};

template <typename F>
static void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
  WorkPool::instance().parallel_for(begin, end, grain, body);
}

// ---- small-batch linear: y = x W^T (+ b) (+ residual) without BLAS for x of up to tiled_rows_limit rows --------
// A decode step of a few sequences is a chain of matrix-vector products bound by reading the weights. BLAS sgemm
// reaches only 30-40 % of the memory bandwidth there on some CPUs (MKL on AMD EPYC: 16 GB/s of ~50, worse for 2-4
// rows); a plain streaming loop that reads each weight row once for all rows of x reaches the bandwidth torch.sum
// reads at. Measured on AMD EPYC (2 threads), the 120 matrices of a SmolLM2-135M forward, this kernel's time /
// MKL's: 1 row 0.37, 2 0.25, 4 0.29, 6 0.45. From 7 rows, tiles of 3 input rows x 8 weight rows (the weight tile
// stays in L1 while every row of x passes it): 7 rows 0.42, 8 0.45, 16 0.53, 64 0.66, 256 0.73. Where MKL is the
// faster one (other CPUs, long prefill chunks), engine/fused_layers.py measures it once and lowers the limit.
constexpr int64_t kMaxGemvRows = 6;
static int64_t tiled_rows_limit = 1 << 30;  // set once per process by set_tiled_rows_limit (a property of the CPU)

typedef float Vec16 __attribute__((vector_size(64)));  // GCC lowers it to the widest registers -march allows

static inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

// Horizontal sum as a tree of halves: ~8 instructions instead of 15 dependent scalar adds (a matrix-vector
// product does one per output; measured 3-7 % more bandwidth than the scalar loop).
static inline float sum16(Vec16 v) {
  const Vec8 eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) +
                    __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// a . b over n floats (the dot products of decode attention and the sum of squares of RMS norm).
static inline float dot(const float* a, const float* b, int64_t n) {
  Vec16 acc = Vec16{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
  float sum = sum16(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Output column n for M rows of x: weight row n is read once, front to back (one sequential stream per thread is
// what the hardware prefetchers follow best; interleaving several rows measured 10-15 % slower), into U
// independent accumulators per row of x to hide the FMA latency.
template <int M, int U>
static inline void gemv_column(const float* x, const float* w, const float* bias, const float* residual, float* y,
                               int64_t K, int64_t N, int64_t n) {
  const float* row = w + n * K;
  Vec16 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = Vec16{};
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    Vec16 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = load16(row + k + 16 * u);
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] += wv[u] * load16(x + m * K + k + 16 * u);
  }
  for (; k + 16 <= K; k += 16) {
    const Vec16 wv = load16(row + k);
    for (int m = 0; m < M; ++m) acc[m][0] += wv * load16(x + m * K + k);
  }
  for (int m = 0; m < M; ++m) {
    Vec16 total = acc[m][0];
    for (int u = 1; u < U; ++u) total += acc[m][u];
    float sum = sum16(total);
    for (int64_t j = k; j < K; ++j) sum += row[j] * x[m * K + j];
    if (bias != nullptr) sum += bias[n];
    y[m * N + n] = residual != nullptr ? residual[m * N + n] + sum : sum;
  }
}

template <int M, int U>
static void gemv(const float* x, const float* w, const float* bias, const float* residual, float* y, int64_t K,
                 int64_t N) {
  parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) gemv_column<M, U>(x, w, bias, residual, y, K, N, n);
  });
}

// Rows m0..m0+MR of y, columns n0..n0+NR: MR x NR dot products over K, the NR weight rows read once per MR rows of x.
template <int MR, int NR>
static inline void linear_tile(const float* x, const float* w, const float* bias, const float* residual, float* y,
                               int64_t K, int64_t N, int64_t m0, int64_t n0) {
  Vec16 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = Vec16{};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    Vec16 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load16(w + (n0 + r) * K + k);
    for (int m = 0; m < MR; ++m) {
      const Vec16 xv = load16(x + (m0 + m) * K + k);
      for (int r = 0; r < NR; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      float sum = sum16(acc[m][r]);
      for (int64_t j = k; j < K; ++j) sum += x[(m0 + m) * K + j] * w[(n0 + r) * K + j];
      const int64_t n = n0 + r, at = (m0 + m) * N + n;
      if (bias != nullptr) sum += bias[n];
      y[at] = residual != nullptr ? residual[at] + sum : sum;
    }
}

// Columns n0..n0+NR for all M rows of x, 3 rows at a time.
template <int NR>
static void linear_columns(const float* x, const float* w, const float* bias, const float* residual, float* y,
                           int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 3 <= M; m0 += 3) linear_tile<3, NR>(x, w, bias, residual, y, K, N, m0, n0);
  if (M - m0 == 2) linear_tile<2, NR>(x, w, bias, residual, y, K, N, m0, n0);
  if (M - m0 == 1) linear_tile<1, NR>(x, w, bias, residual, y, K, N, m0, n0);
}

static void tiled_linear(const float* x, const float* w, const float* bias, const float* residual, float* y,
                         int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kTile = 8;
  const int64_t tiles = N / kTile;
  parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) linear_columns<kTile>(x, w, bias, residual, y, M, K, N, t * kTile);
  });
  for (int64_t n = tiles * kTile; n < N; ++n) linear_columns<1>(x, w, bias, residual, y, M, K, N, n);
}

void set_tiled_rows_limit(int64_t rows) {
  TORCH_CHECK(rows >= 0, "tiled rows limit must be >= 0, got ", rows);
  tiled_rows_limit = rows;
}

int64_t get_tiled_rows_limit() { return tiled_rows_limit; }

// residual + at::linear(input, weight, bias) (residual optional): the streaming kernel for fp32 inputs of at most
// kMaxGemvRows rows, tiles up to tiled_rows_limit rows, BLAS above; the residual is added in the same pass.
Tensor small_batch_linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias,
                          const std::optional<Tensor>& residual) {
  const bool without_blas =
      input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && input.dim() == 2 &&
      input.size(0) <= std::max(kMaxGemvRows, tiled_rows_limit) && input.size(0) > 0 && weight.is_contiguous() &&
      input.is_cpu() &&
      weight.is_cpu() && (!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == at::kFloat)) &&
      (!residual.has_value() || (residual->is_contiguous() && residual->scalar_type() == at::kFloat &&
                                 residual->dim() == 2 && residual->size(0) == input.size(0) &&
                                 residual->size(1) == weight.size(0)));
  if (!without_blas) {
    Tensor out = at::linear(input, weight, bias);
    return residual.has_value() ? *residual + out : out;
  }
  const Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "linear: input has ", K, " features, weight expects ", weight.size(1));
  Tensor y = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* r = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: gemv<1, 4>(xp, wp, b, r, yp, K, N); break;
    case 2: gemv<2, 4>(xp, wp, b, r, yp, K, N); break;
    case 3: gemv<3, 2>(xp, wp, b, r, yp, K, N); break;
    case 4: gemv<4, 2>(xp, wp, b, r, yp, K, N); break;
    case 5: gemv<5, 1>(xp, wp, b, r, yp, K, N); break;
    case 6: gemv<6, 1>(xp, wp, b, r, yp, K, N); break;
    default: tiled_linear(xp, wp, b, r, yp, M, K, N); break;
  }
  return y;
}

// ---- rotary embedding of queries and keys, and the KV cache write, in one pass ----------------------------------
// qkv [tokens, (heads + 2 kv_heads) * dim] (the fused projection); cos / signed sin [tokens, 1, dim] (engine/model.py's
// _rope: x * cos + roll(x, dim / 2) * signed_sin); the rotated keys and the values go to their slots in the layer's
// caches [blocks, block_size, kv_heads, dim]. Returns the rotated queries [tokens, heads, dim] and the rotated keys and
// values [tokens, kv_heads, dim] (prefill chunks with nothing cached attend to them directly).
std::vector<Tensor> rotary_cache_write(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                                       const Tensor& slot_mapping, const Tensor& layer_keys,
                                       const Tensor& layer_values, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_dim) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && layer_keys.scalar_type() == at::kFloat, "rotary_cache_write: fp32 only");
  TORCH_CHECK(qkv.is_cpu() && layer_keys.is_cpu() && layer_values.is_cpu(), "rotary_cache_write: CPU tensors only");
  TORCH_CHECK(layer_keys.is_contiguous() && layer_values.is_contiguous(), "rotary_cache_write: contiguous caches only");
  const Tensor in = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous();
  const Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t tokens = in.size(0), width = in.size(1), half = head_dim / 2;
  const int64_t num_slots = layer_keys.size(0) * layer_keys.size(1);
  TORCH_CHECK(width == (num_heads + 2 * num_kv_heads) * head_dim, "rotary_cache_write: qkv width ", width);
  Tensor q = at::empty({tokens, num_heads, head_dim}, in.options());
  Tensor k = at::empty({tokens, num_kv_heads, head_dim}, in.options());
  Tensor v = at::empty({tokens, num_kv_heads, head_dim}, in.options());
  const float *ip = in.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *key_cache = layer_keys.data_ptr<float>(), *value_cache = layer_values.data_ptr<float>();
  const int64_t kv_width = num_kv_heads * head_dim;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rotary_cache_write: slot ", slot[t], " outside the cache");
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = ip + t * width;
      const float *ct = cp + t * head_dim, *st = sp + t * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        const float* x = row + h * head_dim;
        float* out = h < num_heads ? qp + (t * num_heads + h) * head_dim : kp + (t * num_kv_heads + h - num_heads) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          const float a = x[d] * ct[d], b = x[d < half ? d + half : d - half] * st[d];
          out[d] = a + b;
        }
      }
      std::memcpy(vp + t * kv_width, row + (num_heads + num_kv_heads) * head_dim, kv_width * sizeof(float));
      std::memcpy(key_cache + slot[t] * kv_width, kp + t * kv_width, kv_width * sizeof(float));
      std::memcpy(value_cache + slot[t] * kv_width, vp + t * kv_width, kv_width * sizeof(float));
    }
  });
  return {q, k, v};
}

// ---- SiLU(gate) * up, gate_up [rows, 2 I] -> [rows, I] ----------------------------------------------------------
Tensor silu_and_mul(const Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_cpu(), "silu_and_mul: fp32 CPU tensors only");
  const Tensor in = gate_up.contiguous();
  const int64_t rows = in.size(0), inner = in.size(1) / 2;
  Tensor out = at::empty({rows, inner}, in.options());
  const float* ip = in.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = ip + r * 2 * inner, *up = gate + inner;
      for (int64_t i = 0; i < inner; ++i) op[r * inner + i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// ---- RMS norm: x * rsqrt(mean(x^2) + eps) * weight, one pass per row ------------------------------------------
// at::rms_norm is ~7 ATen calls (~15 us on a 576-float row, twice per layer); this loop takes well under 1 us. The
// sum of squares is accumulated in a different order than ATen's, so the last bit may differ.
Tensor rms_norm(const Tensor& input, const Tensor& weight, double eps) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: fp32 only");
  TORCH_CHECK(input.is_cpu() && weight.is_cpu(), "rms_norm: CPU tensors only");
  const Tensor x = input.contiguous();
  const Tensor w = weight.contiguous();
  const int64_t width = x.size(-1), rows = width == 0 ? 0 : x.numel() / width;
  TORCH_CHECK(w.numel() == width, "rms_norm: weight has ", w.numel(), " elements, rows have ", width);
  Tensor out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * width;
      const float squares = dot(row, row, width);
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
      for (int64_t k = 0; k < width; ++k) op[r * width + k] = row[k] * inverse * wp[k];
    }
  });
  return out;
}

// ---- decode attention straight from the paged cache ------------------------------------------------------------
// One query token per sequence against its cached keys and values, read in place through the block table: no
// gathered copy of the context (which grows with context length and batch), one task per (sequence, query head).
// Two passes per task: scores into a buffer, then softmax-weighted values.
// f(t, slot) for each of a sequence's first `context` cached tokens, block by block through its block table (a
// division per token, twice per token and head, cost more than the dot products); `cache` points at the head.
template <typename F>
static inline void for_each_cached_token(const float* cache, const int64_t* table, int64_t context,
                                         int64_t block_size, int64_t token_stride, const F& f) {
  for (int64_t start = 0, b = 0; start < context; start += block_size, ++b) {
    const float* block = cache + table[b] * block_size * token_stride;
    const int64_t n = std::min(block_size, context - start);
    for (int64_t i = 0; i < n; ++i) f(start + i, block + i * token_stride);
  }
}

static void decode_attention_task(const float* q, const float* key_cache, const float* value_cache,
                                  const int64_t* table, int64_t context, int64_t block_size, int64_t kv_heads,
                                  int64_t kv_head, int64_t dim, float scale, float* scores, float* out) {
  const int64_t token_stride = kv_heads * dim;  // floats between consecutive slots of a block
  float max_score = -INFINITY;
  for_each_cached_token(key_cache + kv_head * dim, table, context, block_size, token_stride,
                        [&](int64_t t, const float* key) {
                          const float score = dot(q, key, dim) * scale;
                          scores[t] = score;
                          max_score = std::max(max_score, score);
                        });
  float total = 0.f;
  for (int64_t t = 0; t < context; ++t) total += (scores[t] = std::exp(scores[t] - max_score));
  std::fill(out, out + dim, 0.f);
  for_each_cached_token(value_cache + kv_head * dim, table, context, block_size, token_stride,
                        [&](int64_t t, const float* v) {
                          const float weight = scores[t];
                          for (int64_t d = 0; d < dim; ++d) out[d] += weight * v[d];
                        });
  const float inverse = 1.f / total;
  for (int64_t d = 0; d < dim; ++d) out[d] *= inverse;
}

// query [seqs, heads, dim]; caches [blocks, block_size, kv_heads, dim]; block_tables [seqs, >= ceil(context /
// block_size)]; context_lens [seqs]. Returns [seqs, heads, dim]. fp32 caches only.
Tensor decode_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                        const Tensor& block_tables, const Tensor& context_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat, "decode_attention: fp32 only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "decode_attention: contiguous caches only");
  TORCH_CHECK(query.is_cpu() && key_cache.is_cpu() && value_cache.is_cpu(), "decode_attention: CPU tensors only");
  const Tensor q = query.contiguous();
  const Tensor tables = block_tables.to(at::kLong).contiguous();
  const Tensor lens = context_lens.to(at::kLong).contiguous();
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t table_width = tables.size(1), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && key_cache.size(3) == dim, "decode_attention: head shapes do not match");
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(len_ptr[s] >= 1 && len_ptr[s] <= table_width * block_size,
                "decode_attention: context length ", len_ptr[s], " outside the block table");
    longest = std::max(longest, len_ptr[s]);
  }
  Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = key_cache.data_ptr<float>(), *vp = value_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  parallel_for(0, seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, h = task % heads;
      decode_attention_task(qp + task * dim, kp, vp, tp + s * table_width, len_ptr[s], block_size, kv_heads,
                            h / group, dim, static_cast<float>(scale), scores.data(), op + task * dim);
    }
  });
  return out;
}

// ---- the layer loop ---------------------------------------------------------------------------------------------

// [seqs, blocks] block ids -> [seqs, kv_heads, blocks * block_size, dim] (engine/attention.py's _gather)
static Tensor gather(const Tensor& cache, const Tensor& block_tables) {
  const int64_t seqs = block_tables.size(0);
  const int64_t blocks = block_tables.size(1);
  return cache.index_select(0, block_tables.reshape({-1}))
      .view({seqs, blocks * cache.size(1), cache.size(2), cache.size(3)})
      .transpose(1, 2);
}

// engine/attention.py's paged_attention, op for op. Decode groups: starts/ends/tables/context lengths;
// prefill chunks: the same fields (a chunk's table is [blocks]; no mask: nothing cached before the chunk).
struct Batch {
  std::vector<int64_t> decode_start, decode_end;
  std::vector<Tensor> decode_tables, decode_context_lens;
  std::vector<int64_t> prefill_start, prefill_end, prefill_context;
  std::vector<Tensor> prefill_tables;
  std::vector<std::optional<Tensor>> prefill_masks;
};

static Tensor decode_group(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache, const Batch& b,
                           size_t g, double scale) {
  return decode_attention(query.slice(0, b.decode_start[g], b.decode_end[g]), key_cache, value_cache,
                          b.decode_tables[g], b.decode_context_lens[g], scale);
}

static Tensor paged_attention(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& key_cache,
                              const Tensor& value_cache, const Batch& b, double scale) {
  if (b.decode_start.size() == 1 && b.prefill_start.empty())
    return decode_group(query, key_cache, value_cache, b, 0, scale);
  Tensor out = at::empty_like(query);
  for (size_t g = 0; g < b.decode_start.size(); ++g)
    out.slice(0, b.decode_start[g], b.decode_end[g]).copy_(decode_group(query, key_cache, value_cache, b, g, scale));
  for (size_t c = 0; c < b.prefill_start.size(); ++c) {
    const int64_t start = b.prefill_start[c], end = b.prefill_end[c];
    Tensor q = query.slice(0, start, end).transpose(0, 1).unsqueeze(0);
    Tensor o;
    if (!b.prefill_masks[c].has_value()) {
      Tensor k = key.slice(0, start, end).transpose(0, 1).unsqueeze(0);
      Tensor v = value.slice(0, start, end).transpose(0, 1).unsqueeze(0);
      o = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true, scale, true);
    } else {
      Tensor k = gather(key_cache, b.prefill_tables[c].unsqueeze(0)).narrow(2, 0, b.prefill_context[c]);
      Tensor v = gather(value_cache, b.prefill_tables[c].unsqueeze(0)).narrow(2, 0, b.prefill_context[c]);
      o = at::scaled_dot_product_attention(q, k, v, b.prefill_masks[c], 0.0, false, scale, true);
    }
    out.slice(0, start, end).copy_(o.squeeze(0).transpose(0, 1));
  }
  return out;
}

// LlamaModel.forward's layer loop (engine/model.py), op for op.
Tensor decoder_layers(Tensor hidden, const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping,
                      std::vector<int64_t> decode_start, std::vector<int64_t> decode_end,
                      std::vector<Tensor> decode_tables, std::vector<Tensor> decode_context_lens,
                      std::vector<int64_t> prefill_start,
                      std::vector<int64_t> prefill_end, std::vector<int64_t> prefill_context,
                      std::vector<Tensor> prefill_tables, std::vector<std::optional<Tensor>> prefill_masks,
                      const std::vector<Tensor>& input_norm, const std::vector<Tensor>& qkv,
                      const std::vector<Tensor>& qkv_bias, const std::vector<Tensor>& o_proj,
                      const std::vector<Tensor>& post_norm, const std::vector<Tensor>& gate_up,
                      const std::vector<Tensor>& down, const Tensor& key_cache, const Tensor& value_cache,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  const Batch b{std::move(decode_start), std::move(decode_end), std::move(decode_tables),
                std::move(decode_context_lens), std::move(prefill_start), std::move(prefill_end),
                std::move(prefill_context), std::move(prefill_tables), std::move(prefill_masks)};
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim;
  for (size_t i = 0; i < qkv.size(); ++i) {
    Tensor x = rms_norm(hidden, input_norm[i], eps);
    std::optional<Tensor> bias;
    if (!qkv_bias.empty()) bias = qkv_bias[i];
    Tensor layer_keys = key_cache.select(0, static_cast<int64_t>(i));
    Tensor layer_values = value_cache.select(0, static_cast<int64_t>(i));
    auto qkv_rotated = rotary_cache_write(small_batch_linear(x, qkv[i], bias, std::nullopt), cos, sin, slot_mapping,
                                          layer_keys, layer_values, num_heads, num_kv_heads, head_dim);
    Tensor attn = paged_attention(qkv_rotated[0], qkv_rotated[1], qkv_rotated[2], layer_keys, layer_values, b, scale);
    hidden = small_batch_linear(attn.view({tokens, q_size}), o_proj[i], std::nullopt, hidden);
    x = rms_norm(hidden, post_norm[i], eps);
    hidden = small_batch_linear(silu_and_mul(small_batch_linear(x, gate_up[i], std::nullopt, std::nullopt)), down[i],
                                std::nullopt, hidden);
  }
  return hidden;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers", &decoder_layers, "the decoder's layer loop for one step (engine/model.py, in C++)");
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * weight over the last dimension (fp32)");
  m.def("decode_attention", &decode_attention, "decode attention straight from the paged KV cache (fp32)");
  m.def("linear", &small_batch_linear, "residual + at::linear(input, weight, bias), without BLAS up to the limit",
        py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("residual") = py::none());
  m.def("set_tiled_rows_limit", &set_tiled_rows_limit, "inputs of more rows than this (and > 6) go to at::linear");
  m.def("get_tiled_rows_limit", &get_tiled_rows_limit, "the limit set_tiled_rows_limit set");
  m.def("rotary_cache_write", &rotary_cache_write, "rotary queries/keys, and the new keys/values into the cache");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of the fused gate/up projection");
}
