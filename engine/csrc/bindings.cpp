// The Python module (built by engine/fused_layers.py).
#include <torch/extension.h>

#include "kernels.h"
#include "linear_bf16_amx.h"
#include "linear_bf16_dot.h"
#include "linear_bf16_vnni.h"

// The compute functions take and return tensors only and let go of the GIL while they run: a step's forward pass
// would otherwise stop every other Python thread (the HTTP server sending the last step's tokens) until it ends.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  // The layer loop's three records: made from keyword arguments only, checked once as they are made.
  py::class_<StepPlan>(m, "StepPlan", "which rows of a step are decode groups and which prefill chunks")
      .def(py::init([](std::vector<int64_t> decode_start, std::vector<int64_t> decode_end,
                       std::vector<Tensor> decode_tables, std::vector<Tensor> decode_context_lens,
                       std::vector<int64_t> prefill_start, std::vector<int64_t> prefill_end,
                       std::vector<int64_t> prefill_context, std::vector<Tensor> prefill_tables,
                       std::vector<std::optional<Tensor>> prefill_masks) {
             StepPlan plan{std::move(decode_start),   std::move(decode_end),     std::move(decode_tables),
                           std::move(decode_context_lens), std::move(prefill_start), std::move(prefill_end),
                           std::move(prefill_context), std::move(prefill_tables), std::move(prefill_masks)};
             plan.check();
             return plan;
           }),
           py::kw_only(), py::arg("decode_start"), py::arg("decode_end"), py::arg("decode_tables"),
           py::arg("decode_context_lens"), py::arg("prefill_start"), py::arg("prefill_end"),
           py::arg("prefill_context"), py::arg("prefill_tables"), py::arg("prefill_masks"));
  py::class_<LayerWeights>(m, "LayerWeights", "the decoder's weights, one entry per layer")
      .def(py::init([](std::vector<Tensor> input_norm, std::vector<Tensor> qkv, std::vector<Tensor> qkv_bias,
                       std::vector<Tensor> o_proj, std::vector<Tensor> post_norm, std::vector<Tensor> gate_up,
                       std::vector<Tensor> down) {
             LayerWeights w{std::move(input_norm), std::move(qkv),     std::move(qkv_bias), std::move(o_proj),
                            std::move(post_norm),  std::move(gate_up), std::move(down)};
             w.check();
             return w;
           }),
           py::kw_only(), py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o_proj"),
           py::arg("post_norm"), py::arg("gate_up"), py::arg("down"));
  py::class_<ModelDims>(m, "ModelDims", "the model's attention sizes and constants")
      .def(py::init([](int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
             ModelDims d{num_heads, num_kv_heads, head_dim, eps, scale};
             d.check();
             return d;
           }),
           py::kw_only(), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"));
  m.def("decoder_layers", &decoder_layers, "the decoder's layer loop for one step (engine/model.py, in C++)",
        py::arg("hidden"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"), py::arg("plan"),
        py::arg("weights"), py::arg("key_cache"), py::arg("value_cache"), py::arg("dims"), nogil);
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * weight over the last dimension (fp32)", nogil);
  m.def("decode_attention", &decode_attention, "decode attention straight from the paged KV cache (fp32)", nogil);
  m.def("prefill_attention", &prefill_attention,
        "a prefill chunk's causal attention over its cached context and itself, from the paged bf16 cache", nogil);
  m.def("linear", &small_batch_linear, "residual + at::linear(input, weight, bias), without BLAS up to the limit",
        py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("residual") = py::none(), nogil);
  m.def("set_tiled_rows_limit", &set_tiled_rows_limit, "inputs of more rows than this (and > 6) go to at::linear",
        py::arg("rows"), py::arg("bf16") = false);
  m.def("get_tiled_rows_limit", &get_tiled_rows_limit, "the limit set_tiled_rows_limit set", py::arg("bf16") = false);
  m.def("set_bf16_kernel", &set_bf16_kernel,
        "bf16 weights: 'amx' or 'vnni' (on packed weights), 'dot' (vdpbf16ps) or 'widen' (on plain ones)");
  m.def("get_bf16_kernel", &get_bf16_kernel, "the bf16 kernel in use");
  m.def("bf16_dot_supported", &bf16_dot_supported, "whether this CPU executes AVX512-BF16");
  m.def("amx_supported", &amx_supported, "whether this CPU executes AMX-BF16 and the OS grants the tiles");
  m.def("pack_vnni_weight", &pack_vnni_weight, "a bf16 weight [N, K] in the packed layout [N/16, K/32, 16, 32]");
  m.def("pack_weights", &pack_weights, "copies of the tensors, in order, in one buffer on huge pages", nogil);
  m.def("rotary_cache_write", &rotary_cache_write, "rotary queries/keys, and the new keys/values into the cache", nogil);
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of the fused gate/up projection", nogil);
}
