// The engine's CPU kernels (fp32): the decoder's layer loop for one step (decode groups and prefill chunks) in C++,
// the same ops in the same order as engine/model.py (LlamaModel.forward) and engine/attention.py (paged_attention),
// so the two loops are bit-identical, without ~1,700 Python -> ATen calls per step; and the kernels both loops use:
// small-batch linear, decode attention over the paged cache, RMS norm, rotary + KV write, SiLU*up; and the packed
// weight buffer. Built once by engine/fused_layers.py (-O3 -march=native).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <sys/mman.h>
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
    // ones shrinking towards the end, measured no faster: each claim is a contended atomic, and each new chunk
    // restarts the hardware prefetchers; 4 / 8 / 16 per thread took 1.0 / 1.05 / 1.07x the time of 2)
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

// ---- packed weights: one buffer on huge pages -----------------------------------------------------------------
// A decode step streams every weight once; on 4 KB pages that is a TLB miss (a page walk) every 4 KB of each
// thread's stream, and torch's allocator does not ask for huge pages. pack_weights copies a model's weights, in
// the order a forward pass reads them, into one buffer on 2 MB pages where the kernel allows it (transparent huge
// pages in "madvise" mode, the usual default). Measured at batch 1 on AMD EPYC: the step 5-10 % shorter.
std::vector<Tensor> pack_weights(const std::vector<Tensor>& tensors) {
  constexpr size_t kLine = 64, kHugePage = 2 << 20;
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const Tensor& t : tensors) {
    TORCH_CHECK(t.is_cpu(), "pack_weights: CPU tensors only");
    offsets.push_back(total);
    total += (t.nbytes() + kLine - 1) / kLine * kLine;
  }
  const size_t allocated = std::max(kHugePage, (total + kHugePage - 1) / kHugePage * kHugePage);
  void* memory = nullptr;
  TORCH_CHECK(posix_memalign(&memory, kHugePage, allocated) == 0, "pack_weights: cannot allocate ", allocated,
              " bytes");
  madvise(memory, allocated, MADV_HUGEPAGE);  // a hint: where the kernel declines it, 4 KB pages serve
  const Tensor buffer = at::from_blob(
      memory, {static_cast<int64_t>(allocated)},
      [](void* data) { free(data); },
      at::TensorOptions().dtype(at::kByte));
  std::vector<Tensor> views;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    Tensor view = buffer.narrow(0, static_cast<int64_t>(offsets[i]), static_cast<int64_t>(t.nbytes()))
                      .view(t.scalar_type())
                      .view(t.sizes());
    view.copy_(t);
    views.push_back(view);
  }
  return views;
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

typedef int32_t VecI16 __attribute__((vector_size(64)));

// exp of 16 floats at once (Cephes' expf: n = round(x / ln 2), exp(x) = 2^n * exp(x - n ln 2) with a degree-6
// polynomial; within 1-2 ulp of std::exp, which costs ~20 cycles per call where this is ~2 per value). Inputs are
// clamped to [-87.3, 88.7]: below, ~1e-38 instead of 0 (softmax weights of a vanishing score); above, 3.4e38.
static inline Vec16 exp16(Vec16 x) {
  const Vec16 lowest = Vec16{} - 87.3f, highest = Vec16{} + 88.7f;
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const Vec16 n = (x * 1.44269504088896341f + kRound) - kRound;
  const Vec16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts: x - n ln 2 exactly enough
  Vec16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const VecI16 exponent = (__builtin_convertvector(n, VecI16) + 127) << 23;
  return p * reinterpret_cast<const Vec16&>(exponent);
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
      int64_t i = 0;
      for (; i + 16 <= inner; i += 16) {
        const Vec16 g = load16(gate + i);
        const Vec16 y = g / (1.f + exp16(-g)) * load16(up + i);
        std::memcpy(op + r * inner + i, &y, sizeof y);
      }
      for (; i < inner; ++i) op[r * inner + i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
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
// One query token per sequence against its cached keys and values, read in place through the block table (no
// gathered copy of the context, which grows with context length and batch). A task is one sequence's query heads
// over one slice of its context, 16 tokens at a time: the 16 dot products of a query head are summed across their
// lanes together (a transposing tree, ~3 instructions per token instead of ~9), and the query heads that share a
// KV head (grouped-query attention) read its rows from L1. A short batch splits each context into slices so that
// both threads have work (batch 1 would be one task), and the slices' partial results are merged after.

constexpr int64_t kTokenGroup = 16;
alignas(64) static const float kZeroRow[256] = {};  // stands in for the missing rows of a last, partial group

// rows[i] = the cache row of token t0 + i (i < count), through the block table; `stride` floats per token.
static inline void token_rows(const float* cache, const int64_t* table, int64_t t0, int64_t count,
                              int64_t block_size, int64_t stride, const float** rows) {
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
template <int DV>
static inline void score_group(const float* q, const float* const* rows, int64_t offset, int64_t count, float scale,
                               float* scores) {
  const float* r[kTokenGroup];
  for (int64_t i = 0; i < kTokenGroup; ++i) r[i] = i < count ? rows[i] + offset : kZeroRow;
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
template <int DV, int H>
static inline void accumulate_group(const float* weights, int64_t weight_stride, const float* const* rows,
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
template <typename Score, typename Accumulate>
static inline void attend_slice_passes(const float* key_cache, const float* value_cache, const int64_t* table,
                                       int64_t first, int64_t last, int64_t block_size, int64_t stride,
                                       int64_t heads, int64_t dim, float* scores, int64_t width, Partial* partials,
                                       float* outputs, const Score& score, const Accumulate& accumulate) {
  const float* rows[kTokenGroup];
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
template <int DV>
static void attend_slice(const float* q, const float* key_cache, const float* value_cache, const int64_t* table,
                         int64_t first, int64_t last, int64_t block_size, int64_t heads, int64_t kv_heads,
                         float scale, float* scores, int64_t width, Partial* partials, float* outputs) {
  constexpr int64_t dim = 16 * DV;
  constexpr int64_t kMaxHeads = std::max(1, 16 / DV);  // running sums of at most 16 registers
  const int64_t group = heads / kv_heads;
  const auto score = [&](const float* const* rows, int64_t offset, int64_t count) {
    for (int64_t h = 0; h < heads; ++h)
      score_group<DV>(q + h * dim, rows, h / group * dim, count, scale, scores + h * width + offset);
  };
  const auto accumulate = [&](const float* const* rows, int64_t offset, int64_t count) {
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
static void attend_slice_any(const float* q, const float* key_cache, const float* value_cache, const int64_t* table,
                             int64_t first, int64_t last, int64_t block_size, int64_t heads, int64_t kv_heads,
                             int64_t dim, float scale, float* scores, int64_t width, Partial* partials,
                             float* outputs) {
  const int64_t group = heads / kv_heads;
  const auto score = [&](const float* const* rows, int64_t offset, int64_t count) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < count; ++i)
        scores[h * width + offset + i] = dot(q + h * dim, rows[i] + h / group * dim, dim) * scale;
  };
  const auto accumulate = [&](const float* const* rows, int64_t offset, int64_t count) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < count; ++i) {
        const float w = scores[h * width + offset + i];
        const float* v = rows[i] + h / group * dim;
        for (int64_t d = 0; d < dim; ++d) outputs[h * dim + d] += w * v[d];
      }
  };
  attend_slice_passes(key_cache, value_cache, table, first, last, block_size, kv_heads * dim, heads, dim, scores,
                      width, partials, outputs, score, accumulate);
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
  const float *qp = q.data_ptr<float>(), *kp = key_cache.data_ptr<float>(), *vp = value_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
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
  m.def("pack_weights", &pack_weights, "copies of the tensors, in order, in one buffer on huge pages");
  m.def("rotary_cache_write", &rotary_cache_write, "rotary queries/keys, and the new keys/values into the cache");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of the fused gate/up projection");
}
