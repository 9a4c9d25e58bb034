// The drafter's block-only ops on the CPU as single loops with the bits of the MLX ops they
// replace (cpu/draft_step.py): an RMSNorm, one side of DFlash 2's two-tap conv, and the
// attention's softmax of powers of 2. Included by exact_ops.cpp (built with
// -ffp-contract=off: no product is fused into a sum).
#pragma once

#include <cmath>
#include <cstddef>

namespace {

// MLX's mx.fast.rms_norm fallback on the CPU (mlx/fast.cpp; its wheel reduces one element at
// a time): per row, sum of the rounded squares in order from 0, times (float)(1.0 / d), plus
// eps, 1 / sqrt, then (x * r) * w. RB rows at once, one independent sum each: the order
// within a row is MLX's, the rows only interleave.
void rms_norm_rows(const float* __restrict x, const float* __restrict w, float* __restrict out,
                   size_t rows, size_t d, float eps) {
  constexpr size_t RB = 16;
  const float inv_d = static_cast<float>(1.0 / static_cast<double>(d));
  for (size_t r0 = 0; r0 < rows; r0 += RB) {
    const size_t nb = rows - r0 < RB ? rows - r0 : RB;
    float acc[RB] = {0.0f};
    for (size_t i = 0; i < d; i++)
      for (size_t j = 0; j < nb; j++) {
        const float v = x[(r0 + j) * d + i];
        const float sq = v * v;
        acc[j] = acc[j] + sq;
      }
    for (size_t j = 0; j < nb; j++) {
      const float mean = (0.0f + acc[j]) * inv_d;
      const float r = 1.0f / std::sqrt(mean + eps);
      const float* xr = x + (r0 + j) * d;
      float* o = out + (r0 + j) * d;
      for (size_t i = 0; i < d; i++) o[i] = (xr[i] * r) * w[i];
    }
  }
}

// One side of DFlash 2's two-tap conv over one block (cpu/draft_step.py's _conv, op for op):
// out[t, h] = (b0[h] + d0[t, g]) * x[t, h] + (b1[h] + d1[t, g]) * x[t - 1, h], with x[-1] = 0
// and g = h / gs. x [B, L, H]; b [2, H] and d [B, L, 2, G] are the side's rows of the base
// kernel [2 sides, 2, H] and of the coefficients [B, L, 2 sides, 2, G], read in place.
void two_tap_rows(const float* __restrict x, const float* __restrict b, const float* __restrict d,
                  float* __restrict out, size_t B, size_t L, size_t H, size_t G, int side) {
  const size_t gs = H / G;
  b += static_cast<size_t>(side) * 2 * H;
  for (size_t n = 0; n < B * L; n++) {
    const float* xt = x + n * H;
    const float* dt = d + n * 4 * G + static_cast<size_t>(side) * 2 * G;
    const bool first = n % L == 0;
    for (size_t g = 0; g < G; g++) {
      const float d0 = dt[g], d1 = dt[G + g];
      for (size_t c = 0; c < gs; c++) {
        const size_t h = g * gs + c;
        const float prev = first ? 0.0f : xt[h - H];
        const float k0 = b[h] + d0, k1 = b[H + h] + d1;
        out[n * H + h] = k0 * xt[h] + k1 * prev;
      }
    }
  }
}

// The drafter's CPU softmax of scores in units of log2 (cpu/fastmath.py's attention): per row
// m = max (MLX's maximum: NaN sticks), p = pow(2, x - m) with libm's powf as MLX calls it,
// sum from 0 in order, p / sum: one op, not five (and their broadcasts).
static float (*volatile pow_fn)(float, float) = powf;  // MLX's std::pow(float, float), unfolded

void pow2_softmax_rows(const float* __restrict in, float* __restrict out, size_t rows, size_t m) {
  for (size_t r = 0; r < rows; r++, in += m, out += m) {
    float mx_ = -INFINITY;
    for (size_t i = 0; i < m; i++) mx_ = std::isnan(in[i]) ? in[i] : (in[i] > mx_ ? in[i] : mx_);
    if (std::isnan(mx_)) mx_ = NAN;
    for (size_t i = 0; i < m; i++) out[i] = pow_fn(2.0f, in[i] - mx_);
    float sum = 0.0f;
    for (size_t i = 0; i < m; i++) sum = sum + out[i];
    sum = 0.0f + sum;
    for (size_t i = 0; i < m; i++) out[i] = out[i] / sum;
  }
}

}  // namespace
