// exp(x) exactly as MLX's CPU backend computes it, in a form the compiler vectorises.
// Shared by exact_ops.cpp and decode_attention.h (built with -ffp-contract=off).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) as MLX's CPU backend computes it (simd::exp with one lane).
static inline float exp_mlx(float x0) {
  float x = x0 * 1.442695f;  // log2(e)
  // MLX takes floor(x + 0.5) in double (a float plus the double 0.5): that is rint(x),
  // except at exact halves, which round up. In float, so that the loop vectorises.
  float even = __builtin_rintf(x);
  float ipart = x - even == 0.5f ? even + 1.0f : even;
  float fpart = x - ipart;
  float p = 1.535336188319500e-4f;
  p = __builtin_fmaf(p, fpart, 1.339887440266574e-3f);
  p = __builtin_fmaf(p, fpart, 9.618437357674640e-3f);
  p = __builtin_fmaf(p, fpart, 5.550332471162809e-2f);
  p = __builtin_fmaf(p, fpart, 2.402264791363012e-1f);
  p = __builtin_fmaf(p, fpart, 6.931472028550421e-1f);
  p = __builtin_fmaf(p, fpart, 1.000000000000000f);
  // 2^ipart from its exponent bits; |x0| > 88 and NaN are replaced below, so the
  // conversion of a huge ipart (undefined in C++, any value on x86) never reaches out.
  int32_t bits = (static_cast<int32_t>(ipart) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  float r = scale * p;
  r = x0 != x0 ? x0 : r;  // NaN
  r = x0 > 88.0f ? INFINITY : r;
  r = x0 < -88.0f ? 0.0f : r;
  return r;
}
