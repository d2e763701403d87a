// linear: residual + x W^T (+ b), with its own kernels for small row counts (decode steps, short prefill chunks).
#include <algorithm>
#include <string>
#include <vector>

#include "kernels.h"
#include "linear_bf16_amx.h"
#include "linear_bf16_dot.h"
#include "linear_bf16_vnni.h"
#include "simd.h"
#include "work_pool.h"

// ---- small-batch linear: y = x W^T (+ b) (+ residual) without BLAS for x of up to tiled_rows_limit rows --------
// A decode step of a few sequences is a chain of matrix-vector products bound by reading the weights. BLAS sgemm
// reaches only a fraction of the memory bandwidth there on some CPUs (MKL on AMD EPYC); a plain streaming loop that
// reads each weight row once for all rows of x reaches the bandwidth torch.sum reads at. From 7 rows, tiles of 3
// input rows x 8 weight rows (the weight tile stays in L1 while every row of x passes it). Where BLAS is the faster
// one (other CPUs, long prefill chunks), engine/fused_layers.py measures it once and lowers the limit
// (measurements: BENCHMARKS.md, "The kernels' design measurements").
// bf16 weights (fp32 inputs, outputs and sums), one kernel per process (set_bf16_kernel): "amx" or "vnni" on weights
// packed at load (pack_vnni_weight) for every row count, AMX tiles (linear_bf16_amx.cpp) or vdpbf16ps register tiles
// (linear_bf16_vnni.cpp); on plain weights "dot" (x rounded to bf16 and vdpbf16ps dot products,
// linear_bf16_dot.cpp) or "widen" (the weights widened to fp32 by a shift and the fp32 kernels below, templates on
// the weight type), each up to its own measured limit, and ATen's bf16 linear (oneDNN) above it.
constexpr int64_t kMaxGemvRows = 6;
// Set once per process (properties of the CPU, measured by engine/fused_layers.py).
static int64_t tiled_rows_limit = 1 << 30;
static int64_t bf16_tiled_rows_limit = 1 << 30;
enum class Bf16Kernel { kAmx, kVnni, kDot, kWiden };
static Bf16Kernel bf16_kernel = amx_supported() ? Bf16Kernel::kAmx
                                : bf16_dot_supported() ? Bf16Kernel::kVnni
                                                       : Bf16Kernel::kWiden;

// Output column n for M rows of x: weight row n is read once, front to back (one sequential stream per thread is
// what the hardware prefetchers follow best; interleaving several rows was slower), into U
// independent accumulators per row of x to hide the FMA latency.
template <int M, int U, typename W>
static inline void gemv_column(const float* x, const W* w, const float* bias, const float* residual, float* y,
                               int64_t K, int64_t N, int64_t n) {
  const W* row = w + n * K;
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
    for (int64_t j = k; j < K; ++j) sum += static_cast<float>(row[j]) * x[m * K + j];
    if (bias != nullptr) sum += bias[n];
    y[m * N + n] = residual != nullptr ? residual[m * N + n] + sum : sum;
  }
}

template <int M, int U, typename W>
static void gemv(const float* x, const W* w, const float* bias, const float* residual, float* y, int64_t K,
                 int64_t N) {
  parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) gemv_column<M, U, W>(x, w, bias, residual, y, K, N, n);
  });
}

// Rows m0..m0+MR of y, columns n0..n0+NR: MR x NR dot products over K, the NR weight rows read once per MR rows of x.
template <int MR, int NR, typename W>
static inline void linear_tile(const float* x, const W* w, const float* bias, const float* residual, float* y,
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
      for (int64_t j = k; j < K; ++j) sum += x[(m0 + m) * K + j] * static_cast<float>(w[(n0 + r) * K + j]);
      const int64_t n = n0 + r, at = (m0 + m) * N + n;
      if (bias != nullptr) sum += bias[n];
      y[at] = residual != nullptr ? residual[at] + sum : sum;
    }
}

// Columns n0..n0+NR for all M rows of x, 3 rows at a time.
template <int NR, typename W>
static void linear_columns(const float* x, const W* w, const float* bias, const float* residual, float* y,
                           int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 3 <= M; m0 += 3) linear_tile<3, NR, W>(x, w, bias, residual, y, K, N, m0, n0);
  if (M - m0 == 2) linear_tile<2, NR, W>(x, w, bias, residual, y, K, N, m0, n0);
  if (M - m0 == 1) linear_tile<1, NR, W>(x, w, bias, residual, y, K, N, m0, n0);
}

template <typename W>
static void tiled_linear(const float* x, const W* w, const float* bias, const float* residual, float* y,
                         int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kTile = 8;
  const int64_t tiles = N / kTile;
  parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) linear_columns<kTile, W>(x, w, bias, residual, y, M, K, N, t * kTile);
  });
  for (int64_t n = tiles * kTile; n < N; ++n) linear_columns<1, W>(x, w, bias, residual, y, M, K, N, n);
}

// The streaming kernel up to kMaxGemvRows rows of x, tiles above.
template <typename W>
static void own_linear(const float* xp, const W* wp, const float* b, const float* r, float* yp, int64_t M, int64_t K,
                       int64_t N) {
  switch (M) {
    case 1: gemv<1, 4>(xp, wp, b, r, yp, K, N); break;
    case 2: gemv<2, 4>(xp, wp, b, r, yp, K, N); break;
    case 3: gemv<3, 2>(xp, wp, b, r, yp, K, N); break;
    case 4: gemv<4, 2>(xp, wp, b, r, yp, K, N); break;
    case 5: gemv<5, 1>(xp, wp, b, r, yp, K, N); break;
    case 6: gemv<6, 1>(xp, wp, b, r, yp, K, N); break;
    default: tiled_linear(xp, wp, b, r, yp, M, K, N); break;
  }
}

void set_tiled_rows_limit(int64_t rows, bool bf16) {
  TORCH_CHECK(rows >= 0, "tiled rows limit must be >= 0, got ", rows);
  (bf16 ? bf16_tiled_rows_limit : tiled_rows_limit) = rows;
}

int64_t get_tiled_rows_limit(bool bf16) { return bf16 ? bf16_tiled_rows_limit : tiled_rows_limit; }

void set_bf16_kernel(const std::string& kernel) {
  TORCH_CHECK(kernel == "amx" || kernel == "vnni" || kernel == "dot" || kernel == "widen",
              "bf16 kernel must be 'amx', 'vnni', 'dot' or 'widen', got '", kernel, "'");
  TORCH_CHECK(kernel != "amx" || amx_supported(), "this CPU has no AMX-BF16 (or the OS does not grant the tiles)");
  TORCH_CHECK(kernel == "amx" || kernel == "widen" || bf16_dot_supported(), "this CPU has no AVX512-BF16 (the '",
              kernel, "' kernel)");
  bf16_kernel = kernel == "amx" ? Bf16Kernel::kAmx
                : kernel == "vnni" ? Bf16Kernel::kVnni
                : kernel == "dot" ? Bf16Kernel::kDot
                                  : Bf16Kernel::kWiden;
}

std::string get_bf16_kernel() {
  switch (bf16_kernel) {
    case Bf16Kernel::kAmx: return "amx";
    case Bf16Kernel::kVnni: return "vnni";
    case Bf16Kernel::kDot: return "dot";
    default: return "widen";
  }
}

// Whether bias and residual are what the kernels can read: fp32, contiguous, residual [M, N].
static bool fp32_extras(const std::optional<Tensor>& bias, const std::optional<Tensor>& residual, int64_t M,
                        int64_t N) {
  return (!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == at::kFloat)) &&
         (!residual.has_value() || (residual->is_contiguous() && residual->scalar_type() == at::kFloat &&
                                    residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N));
}

// x [M, K] fp32 -> bf16, rounded to the nearest (as Tensor.to(torch.bfloat16)), into a per-thread buffer of
// `padded` >= n values, the rest zeros (AMX tiles read rows in sixteens).
static const c10::BFloat16* to_bf16(const float* x, int64_t n, int64_t padded) {
  thread_local std::vector<c10::BFloat16> buffer;
  buffer.resize(padded);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(buffer.data() + i, load16(x + i));
  for (; i < n; ++i) buffer[i] = c10::BFloat16(x[i]);
  std::fill(buffer.begin() + n, buffer.begin() + padded, c10::BFloat16(0.0f));
  return buffer.data();
}

// out + bias + residual by ATen, for the forms the kernels do not read (see fp32_extras).
static Tensor with_extras(Tensor out, const std::optional<Tensor>& bias, const std::optional<Tensor>& residual) {
  if (bias.has_value()) out += *bias;
  return residual.has_value() ? *residual + out : out;
}

// fp32 input, a packed bf16 weight (pack_vnni_weight: [N/16, K/32, 16, 32]): fp32 out, any row count; AMX tiles
// where they are the kernel in use, vdpbf16ps register tiles otherwise.
static Tensor packed_weight_linear(const Tensor& input, const Tensor& packed, const std::optional<Tensor>& bias,
                                   const std::optional<Tensor>& residual) {
  TORCH_CHECK(bf16_dot_supported(), "linear: a packed bf16 weight needs a CPU with AVX512-BF16");
  TORCH_CHECK(input.dim() == 2 && input.is_cpu() && packed.is_contiguous(),
              "linear: a packed weight takes a 2-d input");
  const int64_t M = input.size(0), K = packed.size(1) * packed.size(3), N = packed.size(0) * packed.size(2);
  TORCH_CHECK(input.size(1) == K, "linear: input has ", input.size(1), " features, weight expects ", K);
  if (!fp32_extras(bias, residual, M, N))  // rare forms: the product here, the extras by ATen
    return with_extras(packed_weight_linear(input, packed, std::nullopt, std::nullopt), bias, residual);
  Tensor y = at::empty({M, N}, input.options());
  if (M == 0) return y;
  const Tensor x = input.contiguous();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* r = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  if (bf16_kernel == Bf16Kernel::kAmx)
    amx_linear(to_bf16(x.data_ptr<float>(), M * K, (M + 15) / 16 * 16 * K), packed.data_ptr<c10::BFloat16>(), b, r,
               y.data_ptr<float>(), M, K, N);
  else
    vnni_linear(to_bf16(x.data_ptr<float>(), M * K, M * K), packed.data_ptr<c10::BFloat16>(), b, r,
                y.data_ptr<float>(), M, K, N);
  return y;
}

// fp32 input, bf16 weight: fp32 out. The library path rounds its output to bf16 (ATen's bf16 linear).
static Tensor bf16_weight_linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias,
                                 const std::optional<Tensor>& residual) {
  const int64_t M = input.dim() == 2 ? input.size(0) : -1, N = weight.size(0);
  const bool own = M > 0 && M <= std::max<int64_t>(1, bf16_tiled_rows_limit) && weight.is_contiguous() &&
                   weight.dim() == 2 && input.is_cpu() && weight.is_cpu() && fp32_extras(bias, residual, M, N);
  if (!own) return with_extras(at::linear(input.to(at::kBFloat16), weight).to(at::kFloat), bias, residual);
  const Tensor x = input.contiguous();
  const int64_t K = x.size(1);
  TORCH_CHECK(weight.size(1) == K, "linear: input has ", K, " features, weight expects ", weight.size(1));
  Tensor y = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* r = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  if (bf16_kernel != Bf16Kernel::kWiden && bf16_dot_supported()) {  // plain weights under "amx"/"vnni": odd shapes
    bf16_dot_linear(to_bf16(xp, M * K, M * K), wp, b, r, yp, M, K, N);
    return y;
  }
  own_linear(xp, wp, b, r, yp, M, K, N);
  return y;
}

// residual + at::linear(input, weight, bias) (residual optional): the streaming kernel for fp32 inputs of at most
// kMaxGemvRows rows, tiles up to tiled_rows_limit rows, BLAS above; the residual is added in the same pass. A bf16
// weight with an fp32 input: the same in bf16 (bf16_weight_linear), fp32 out.
Tensor small_batch_linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias,
                          const std::optional<Tensor>& residual) {
  if (weight.scalar_type() == at::kBFloat16 && input.scalar_type() == at::kFloat)
    return weight.dim() == 4 ? packed_weight_linear(input, weight, bias, residual)
                             : bf16_weight_linear(input, weight, bias, residual);
  const bool without_blas =
      input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && input.dim() == 2 &&
      input.size(0) <= std::max(kMaxGemvRows, tiled_rows_limit) && input.size(0) > 0 && weight.is_contiguous() &&
      input.is_cpu() && weight.is_cpu() && fp32_extras(bias, residual, input.size(0), weight.size(0));
  if (!without_blas) return with_extras(at::linear(input, weight, bias), std::nullopt, residual);
  const Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "linear: input has ", K, " features, weight expects ", weight.size(1));
  Tensor y = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* r = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  own_linear(xp, wp, b, r, yp, M, K, N);
  return y;
}
