// The bf16 x bf16 dot-product kernels of linear (AVX512-BF16's vdpbf16ps: pairs of bf16 products summed into fp32),
// compiled for that instruction set whatever -march says and run only where the CPU has it.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

// Whether this CPU executes AVX512-BF16 (cpuid, once).
bool bf16_dot_supported();

// y[m, n] = residual[m, n] + bias[n] + x[m] . w[n] over K (bias, residual optional), x and w in bf16; M rows of x:
// 1..6 stream each weight row once for all rows (decode steps), more run in register tiles.
void bf16_dot_linear(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, const float* residual,
                     float* y, int64_t M, int64_t K, int64_t N);
