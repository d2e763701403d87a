// The AMX tile kernels of linear for bf16 weights (Intel AMX-BF16: 16 x 32 bf16 by 32 x 16 bf16 products summed
// into a 16 x 16 fp32 tile per instruction), compiled for that instruction set whatever -march says and run only
// where the CPU has it and the OS grants the tile state.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

// Whether this CPU executes AMX-BF16 and the OS lets this process use the tiles (cpuid and arch_prctl, once).
bool amx_supported();

// y[m, n] = residual[m, n] + bias[n] + x[m] . w[n] over K (bias, residual optional); x bf16 [M, K] with its rows
// padded with zeros to a multiple of 16, w packed by pack_vnni_weight (linear_bf16_vnni.h). Each weight block is read
// once per 32 rows of x.
void amx_linear(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
                float* y, int64_t M, int64_t K, int64_t N);
