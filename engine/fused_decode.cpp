// The decoder's layer loop for a pure-decode step (one decode group, no prefill chunk), in C++: the same ATen ops
// in the same order as engine/model.py (LlamaModel.forward with engine/attention.py's decode path), so the results
// are bit-identical, without ~1,700 Python -> ATen calls per step. Built once by engine/fused_decode.py.
#include <torch/extension.h>

#include <optional>
#include <vector>

using at::Tensor;

Tensor decode_layers(Tensor hidden, const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping,
                     const Tensor& block_tables, int64_t context_len, const std::optional<Tensor>& mask,
                     const std::vector<Tensor>& input_norm, const std::vector<Tensor>& qkv,
                     const std::vector<Tensor>& qkv_bias, const std::vector<Tensor>& o_proj,
                     const std::vector<Tensor>& post_norm, const std::vector<Tensor>& gate_up,
                     const std::vector<Tensor>& down, const Tensor& key_cache, const Tensor& value_cache,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  const int64_t tokens = hidden.size(0);
  const int64_t hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  const int64_t seqs = block_tables.size(0);
  const int64_t blocks = block_tables.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t flat_slots = key_cache.size(1) * block_size;
  const Tensor table = block_tables.reshape({-1});
  const std::vector<int64_t> norm_shape{hidden_size};
  for (size_t i = 0; i < qkv.size(); ++i) {
    Tensor residual = hidden;
    Tensor x = at::rms_norm(hidden, norm_shape, input_norm[i], eps);
    std::optional<Tensor> bias;
    if (!qkv_bias.empty()) bias = qkv_bias[i];
    Tensor qkv_out = at::linear(x, qkv[i], bias);
    auto parts = qkv_out.split_with_sizes({q_size + kv_size, kv_size}, -1);
    Tensor qk = parts[0].view({tokens, num_heads + num_kv_heads, head_dim});
    qk = qk * cos + qk.roll({head_dim / 2}, {-1}) * sin;
    auto qk_parts = qk.split_with_sizes({num_heads, num_kv_heads}, 1);
    Tensor q = qk_parts[0];
    Tensor k = qk_parts[1];
    Tensor v = parts[1].view({tokens, num_kv_heads, head_dim});
    Tensor layer_keys = key_cache.select(0, static_cast<int64_t>(i));
    Tensor layer_values = value_cache.select(0, static_cast<int64_t>(i));
    layer_keys.view({flat_slots, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, k);
    layer_values.view({flat_slots, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, v);
    Tensor keys = layer_keys.index_select(0, table).view({seqs, blocks * block_size, num_kv_heads, head_dim})
                      .transpose(1, 2).narrow(2, 0, context_len);
    Tensor values = layer_values.index_select(0, table).view({seqs, blocks * block_size, num_kv_heads, head_dim})
                        .transpose(1, 2).narrow(2, 0, context_len);
    Tensor attn = at::scaled_dot_product_attention(q.unsqueeze(2), keys, values, mask, 0.0, false, scale, true)
                      .squeeze(2);
    hidden = residual + at::linear(attn.view({tokens, q_size}), o_proj[i]);
    residual = hidden;
    x = at::rms_norm(hidden, norm_shape, post_norm[i], eps);
    auto gu = at::linear(x, gate_up[i]).chunk(2, -1);
    hidden = residual + at::linear(at::silu(gu[0]) * gu[1], down[i]);
  }
  return hidden;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers, "the decoder's layers for one pure-decode step");
}
