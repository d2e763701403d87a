// The packed ("VNNI") layout of bf16 weights, and the matrix kernel on it for CPUs with AVX512-BF16: every 64-byte
// row of the layout holds one pair of K for 16 output columns, so that one vdpbf16ps with a pair of x broadcast adds
// 16 columns' products (outer-product form: no horizontal sums). The AMX tiles (linear_bf16_amx.h) read the same
// layout. Compiled for that instruction set whatever -march says and run only where the CPU has it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

// A weight [N, K] (N a multiple of 16, K of 32) as [N/16, K/32, 16, 32]: block (nb, kb) row r holds the pairs
// (w[16 nb + n][32 kb + 2r], w[16 nb + n][32 kb + 2r + 1]) for n = 0..15, so that each 16 x 32 block of the weight
// is one contiguous 1 KB load (an AMX B tile) and a column block's K is one sequential stream.
at::Tensor pack_vnni_weight(const at::Tensor& weight);

// y[m, n] = residual[m, n] + bias[n] + x[m] . w[n] over K (bias, residual optional); x bf16 [M, K] (rows not
// padded), w packed by pack_vnni_weight. Up to 4 rows one column block at a time, register tiles of up to 6 rows
// by 64 columns above.
void vnni_linear(const c10::BFloat16* x, const c10::BFloat16* packed, const float* bias, const float* residual,
                 float* y, int64_t M, int64_t K, int64_t N);
