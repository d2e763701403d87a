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

// layer_loop.cpp: the decoder's layer loop of one step. Its arguments come bound as three records, each made in
// bindings.cpp from keyword arguments only and checked once as it is made, so that no list can land in another's
// place (parallel lists of tensors in the wrong order would compile, run and give wrong numbers).
struct StepPlan {  // which rows of the step are decode groups and which prefill chunks (engine/attention.py)
  std::vector<int64_t> decode_start, decode_end;
  std::vector<Tensor> decode_tables, decode_context_lens;
  std::vector<int64_t> prefill_start, prefill_end, prefill_context;
  std::vector<Tensor> prefill_tables;
  std::vector<std::optional<Tensor>> prefill_masks;
  void check() const;  // the decode lists of one length, the prefill lists of one length, every range in order
};

struct LayerWeights {  // one entry per layer, in layer order (engine/model.py's LayerWeights)
  std::vector<Tensor> input_norm, qkv, qkv_bias, o_proj, post_norm, gate_up, down;
  void check() const;  // every list one per layer (qkv_bias: empty, or one per layer)
};

struct ModelDims {
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  void check() const;  // positive sizes, query heads a multiple of the KV heads
};

Tensor decoder_layers(Tensor hidden, const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping,
                      const StepPlan& plan, const LayerWeights& weights, const Tensor& key_cache,
                      const Tensor& value_cache, const ModelDims& dims);
