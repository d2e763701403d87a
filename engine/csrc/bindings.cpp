// The Python module (built by engine/fused_layers.py).
#include <torch/extension.h>

#include "kernels.h"

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
