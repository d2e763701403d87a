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

void StepPlan::check() const {
  const size_t groups = decode_start.size(), chunks = prefill_start.size();
  TORCH_CHECK(decode_end.size() == groups && decode_tables.size() == groups && decode_context_lens.size() == groups,
              "StepPlan: the decode lists differ in length");
  TORCH_CHECK(prefill_end.size() == chunks && prefill_context.size() == chunks && prefill_tables.size() == chunks &&
                  prefill_masks.size() == chunks,
              "StepPlan: the prefill lists differ in length");
  for (size_t g = 0; g < groups; ++g)
    TORCH_CHECK(decode_start[g] < decode_end[g], "StepPlan: decode group ", g, " is empty or reversed");
  for (size_t c = 0; c < chunks; ++c)
    TORCH_CHECK(prefill_start[c] < prefill_end[c], "StepPlan: prefill chunk ", c, " is empty or reversed");
}

void LayerWeights::check() const {
  const size_t layers = qkv.size();
  TORCH_CHECK(layers > 0, "LayerWeights: no layers");
  for (const auto* list : {&input_norm, &o_proj, &post_norm, &gate_up, &down})
    TORCH_CHECK(list->size() == layers, "LayerWeights: a list holds ", list->size(), " layers, qkv ", layers);
  TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == layers, "LayerWeights: qkv_bias must be empty or one per layer");
}

void ModelDims::check() const {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0, "ModelDims: sizes must be positive");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "ModelDims: num_heads must be a multiple of num_kv_heads");
}

// engine/attention.py's paged_attention, op for op. Decode groups: starts/ends/tables/context lengths; prefill
// chunks: the same fields (a chunk's table is [blocks]; no mask: nothing cached before the chunk).

static Tensor decode_group(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache, const StepPlan& b,
                           size_t g, double scale) {
  return decode_attention(query.slice(0, b.decode_start[g], b.decode_end[g]), key_cache, value_cache,
                          b.decode_tables[g], b.decode_context_lens[g], scale);
}

static Tensor paged_attention(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& key_cache,
                              const Tensor& value_cache, const StepPlan& b, double scale) {
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
                      const StepPlan& b, const LayerWeights& w, const Tensor& key_cache, const Tensor& value_cache,
                      const ModelDims& dims) {
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = dims.num_heads * dims.head_dim;
  for (size_t i = 0; i < w.qkv.size(); ++i) {
    Tensor x = rms_norm(hidden, w.input_norm[i], dims.eps);
    std::optional<Tensor> bias;
    if (!w.qkv_bias.empty()) bias = w.qkv_bias[i];
    Tensor layer_keys = key_cache.select(0, static_cast<int64_t>(i));
    Tensor layer_values = value_cache.select(0, static_cast<int64_t>(i));
    auto qkv_rotated = rotary_cache_write(small_batch_linear(x, w.qkv[i], bias, std::nullopt), cos, sin, slot_mapping,
                                          layer_keys, layer_values, dims.num_heads, dims.num_kv_heads, dims.head_dim);
    Tensor attn = paged_attention(qkv_rotated[0], qkv_rotated[1], qkv_rotated[2], layer_keys, layer_values, b,
                                  dims.scale);
    hidden = small_batch_linear(attn.view({tokens, q_size}), w.o_proj[i], std::nullopt, hidden);
    x = rms_norm(hidden, w.post_norm[i], dims.eps);
    hidden = small_batch_linear(silu_and_mul(small_batch_linear(x, w.gate_up[i], std::nullopt, std::nullopt)), w.down[i],
                                std::nullopt, hidden);
  }
  return hidden;
}
