// The kernels' entry points (each defined in the .cpp file named after its concept; bindings.cpp exports them).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

using at::Tensor;

// pack_weights.cpp
std::vector<Tensor> pack_weights(const std::vector<Tensor>& tensors);

// linear.cpp
Tensor small_batch_linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias,
                          const std::optional<Tensor>& residual);
void set_tiled_rows_limit(int64_t rows, bool bf16);  // of the fp32 or the bf16-weight kernels
int64_t get_tiled_rows_limit(bool bf16);
void set_bf16_kernel(const std::string& kernel);  // "amx", "vnni" (packed weights), "dot" or "widen" (plain ones)
std::string get_bf16_kernel();

// norm_rotary_silu.cpp
Tensor rms_norm(const Tensor& input, const Tensor& weight, double eps);
std::vector<Tensor> rotary_cache_write(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                                       const Tensor& slot_mapping, const Tensor& layer_keys,
                                       const Tensor& layer_values, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_dim);
Tensor silu_and_mul(const Tensor& gate_up);

// decode_attention.cpp
Tensor decode_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                        const Tensor& block_tables, const Tensor& context_lens, double scale);

// prefill_attention.cpp (bf16 caches, CPUs with AVX512-BF16)
Tensor prefill_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                         const Tensor& block_table, int64_t context_len, double scale);

// layer_loop.cpp
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
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale);
