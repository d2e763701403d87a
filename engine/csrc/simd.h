// 16-float vectors (GCC vector extensions, lowered to the widest registers -march=native allows) and the small
// helpers on them that several kernels share: loads (from fp32 or bf16), horizontal sums, dot products, a vectorized
// exp, bf16 rounding.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

typedef float Vec16 __attribute__((vector_size(64)));  // GCC lowers it to the widest registers -march allows

inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

// Horizontal sum as a tree of halves: ~8 instructions instead of 15 dependent scalar adds (a matrix-vector
// product does one per output; it reads more bandwidth than the scalar loop: BENCHMARKS.md, "The kernels' design
// measurements").
inline float sum16(Vec16 v) {
  const Vec8 eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) +
                    __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}



typedef int32_t VecI16 __attribute__((vector_size(64)));

// exp of 16 floats at once (Cephes' expf: n = round(x / ln 2), exp(x) = 2^n * exp(x - n ln 2) with a degree-6
// polynomial; within 1-2 ulp of std::exp, at a fraction of its cost per value). Inputs are
// clamped to [-87.3, 88.7]: below, ~1e-38 instead of 0 (softmax weights of a vanishing score); above, 3.4e38.
inline Vec16 exp16(Vec16 x) {
  const Vec16 lowest = Vec16{} - 87.3f, highest = Vec16{} + 88.7f;
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const Vec16 n = (x * 1.44269504088896341f + kRound) - kRound;
  const Vec16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts: x - n ln 2 exactly enough
  Vec16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const VecI16 exponent = (__builtin_convertvector(n, VecI16) + 127) << 23;
  return p * reinterpret_cast<const Vec16&>(exponent);
}

// ---- bf16: the upper half of an fp32 ----------------------------------------------------------------------------
// Widened to fp32 by a shift (exact); rounded from fp32 to the nearest, ties to even (as c10::BFloat16 does).
typedef uint16_t VecU16 __attribute__((vector_size(32)));

inline Vec16 load16(const c10::BFloat16* p) {
  VecU16 h;
  std::memcpy(&h, p, sizeof h);
  const VecI16 bits = __builtin_convertvector(h, VecI16) << 16;
  Vec16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline void store16(float* p, Vec16 v) { std::memcpy(p, &v, sizeof v); }

typedef uint32_t VecU32 __attribute__((vector_size(64)));

inline void store16(c10::BFloat16* p, Vec16 v) {  // (no NaNs here: the kernels' values are finite)
  VecU32 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const VecU32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const VecU16 h = __builtin_convertvector(rounded, VecU16);
  std::memcpy(p, &h, sizeof h);
}

// a . b over n values, b fp32 or bf16 (the dot products of decode attention and the sum of squares of RMS norm).
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  Vec16 acc = Vec16{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
  float sum = sum16(acc);
  for (; i < n; ++i) sum += a[i] * static_cast<float>(b[i]);
  return sum;
}

// dst[0..n) = src[0..n) (rounded when T is bf16).
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(dst + i, load16(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}
