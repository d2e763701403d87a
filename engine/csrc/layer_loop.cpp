// decoder_layers: the decoder's layer loop of one step, the same ops in the same order as engine/model.py's
// LlamaModel.forward and engine/attention.py's paged_attention (so the two loops are bit-identical), without
// the ~1,700 Python -> ATen calls a step costs from Python.
#include <optional>
#include <vector>

#include "kernels.h"
#include "linear_bf16_dot.h"

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
  const auto cache_type = key_cache.scalar_type();  // the chunks' attention runs in it (engine/attention.py)
  const bool own_prefill = cache_type == at::kBFloat16 && bf16_dot_supported();
  for (size_t c = 0; c < b.prefill_start.size(); ++c) {
    const int64_t start = b.prefill_start[c], end = b.prefill_end[c];
    if (own_prefill) {
      out.slice(0, start, end).copy_(prefill_attention(query.slice(0, start, end), key_cache, value_cache,
                                                       b.prefill_tables[c], b.prefill_context[c], scale));
      continue;
    }
    Tensor q = query.slice(0, start, end).transpose(0, 1).unsqueeze(0).to(cache_type);
    Tensor o;
    if (!b.prefill_masks[c].has_value()) {
      Tensor k = key.slice(0, start, end).transpose(0, 1).unsqueeze(0).to(cache_type);
      Tensor v = value.slice(0, start, end).transpose(0, 1).unsqueeze(0).to(cache_type);
      o = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true, scale, true);
    } else {
      const Tensor table = b.prefill_tables[c].unsqueeze(0);
      Tensor k = gather(key_cache, table).narrow(2, 0, b.prefill_context[c]);
      Tensor v = gather(value_cache, table).narrow(2, 0, b.prefill_context[c]);
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
