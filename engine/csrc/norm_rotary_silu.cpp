// The per-row kernels of a layer: RMS norm, rotary embedding with the KV cache write, SiLU(gate) * up.
#include <cmath>
#include <cstring>

#include "kernels.h"
#include "simd.h"
#include "work_pool.h"

// ---- rotary embedding of queries and keys, and the KV cache write, in one pass ----------------------------------
// qkv [tokens, (heads + 2 kv_heads) * dim] (the fused projection); cos / signed sin [tokens, 1, dim] (engine/model.py's
// _rope: x * cos + roll(x, dim / 2) * signed_sin); the rotated keys and the values go to their slots in the layer's
// caches [blocks, block_size, kv_heads, dim] (fp32, or bf16: rounded). Returns the rotated queries [tokens, heads,
// dim] and the rotated keys and values [tokens, kv_heads, dim] (prefill chunks with nothing cached attend to them
// directly).
std::vector<Tensor> rotary_cache_write(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                                       const Tensor& slot_mapping, const Tensor& layer_keys,
                                       const Tensor& layer_values, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_dim) {
  const bool bf16 = layer_keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && (bf16 || layer_keys.scalar_type() == at::kFloat) &&
                  layer_values.scalar_type() == layer_keys.scalar_type(),
              "rotary_cache_write: fp32 qkv and fp32 or bf16 caches only");
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
  const int64_t kv_width = num_kv_heads * head_dim;
  void *key_cache = layer_keys.data_ptr(), *value_cache = layer_values.data_ptr();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rotary_cache_write: slot ", slot[t], " outside the cache");
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = ip + t * width;
      const float *ct = cp + t * head_dim, *st = sp + t * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        const float* x = row + h * head_dim;
        float* out = h < num_heads ? qp + (t * num_heads + h) * head_dim
                                   : kp + (t * num_kv_heads + h - num_heads) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          const float a = x[d] * ct[d], b = x[d < half ? d + half : d - half] * st[d];
          out[d] = a + b;
        }
      }
      std::memcpy(vp + t * kv_width, row + (num_heads + num_kv_heads) * head_dim, kv_width * sizeof(float));
      if (bf16) {
        store_row(static_cast<c10::BFloat16*>(key_cache) + slot[t] * kv_width, kp + t * kv_width, kv_width);
        store_row(static_cast<c10::BFloat16*>(value_cache) + slot[t] * kv_width, vp + t * kv_width, kv_width);
      } else {
        std::memcpy(static_cast<float*>(key_cache) + slot[t] * kv_width, kp + t * kv_width, kv_width * sizeof(float));
        std::memcpy(static_cast<float*>(value_cache) + slot[t] * kv_width, vp + t * kv_width,
                    kv_width * sizeof(float));
      }
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
// at::rms_norm is ~7 ATen calls (twice per layer); this is one loop. The
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
