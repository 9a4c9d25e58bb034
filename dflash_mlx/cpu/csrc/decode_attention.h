// Attention for decode widths (a plain step's one query row, a verify's few) on MLX's CPU
// backend, reading the KV cache's keys and values where they lie.
//
// MLX's CPU fallback for scaled_dot_product_attention copies a cache's sliced K/V for every
// layer and step, multiplies each query head by its KV head on its own (a GQA model reads
// its keys once per query head), builds the causal mask as an array, and hands
// probabilities @ values over more than 1,024 keys to OpenBLAS, whose sums for one row
// depend on how many rows are multiplied with it. Here every sum behind one output element
// runs in an order fixed by that row alone:
//   score[j] = dot(scale * q, k[j]) in four interleaved chains over d, (c0 + c1) + (c2 + c3);
//   p        = MLX's precise softmax (max; exp_mlx(s - max); a running sum over j in order;
//              times 1 / sum) over the row's keys: all S (a mask applied MLX's way), or under
//              the causal mask its first S - L + l + 1 (the rest would add exact zeros);
//   out[d]   = the sum over j, in order, of p[j] * v[j][d] (no fused multiply-add).
// So a row has the same bits alone (a plain step) as among others (a verify), at any context
// length. Threads split keys (scores), rows (softmax) or output columns (values), never a sum.
// Included by exact_ops.cpp; built with -ffp-contract=off and OpenMP.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <vector>

#include "exp_mlx.h"

namespace dflash_attention {

enum MaskKind { NONE = 0, CAUSAL = 1, BOOL = 2, ADDITIVE = 3 };
constexpr int MAX_ROWS = 16;     // query rows per call: decode widths (small_gemm.MAX_ROWS)
constexpr int MAX_DIM = 256;     // head dims a key tile holds on the stack
constexpr int KEY_CHUNK = 256;   // keys one score task takes
constexpr int VALUE_CHUNK = 64;  // keys whose values stay in L1 while every row takes them
constexpr long SCRATCH = 1L << 23;  // scores held at once (floats); more: groups in turns

typedef float v8 __attribute__((vector_size(32), aligned(4)));

struct Args {
  int B, H, Hk, L, S, D;
  float scale;
  const float* q;  // [B, H, L, D], row-major
  const float* k;  // [B, Hk, S, D] at these element strides, d contiguous
  int64_t k_b, k_h, k_s;
  const float* v;
  int64_t v_b, v_h, v_s;
  int mask_kind;
  const void* mask;  // [B, H, L, S] at these strides (0 where broadcast)
  int64_t m_b, m_h, m_l, m_s;
  float* out;  // [B, H, L, D], row-major

  int repeats() const { return H / Hk; }
  int rows() const { return repeats() * L; }  // query rows per KV head: t = r * L + l
  int keys(int t) const { return mask_kind == CAUSAL ? S - L + t % L + 1 : S; }
  const float* key(int g, int j) const { return k + (g / Hk) * k_b + (g % Hk) * k_h + j * k_s; }
  const float* value(int g, int j) const {
    return v + (g / Hk) * v_b + (g % Hk) * v_h + j * v_s;
  }
  int64_t row_of(int g, int t) const {  // (b, h, l) of KV group g's row t, as a row index
    const int b = g / Hk, h = (g % Hk) * repeats() + t / L;
    return (static_cast<int64_t>(b) * H + h) * L + t % L;
  }
};

inline v8 load(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void store(float* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }

// Scores of keys [j0, j1) for every row of group g: 8 keys transposed at a time, so each
// score is 8-lane arithmetic with no horizontal sum.
inline void score_keys(const Args& a, const float* qs, float* s, int g, int j0, int j1) {
  alignas(32) float kt[MAX_DIM * 8];  // [D, 8]
  const int T = a.rows(), D = a.D;
  for (int j = j0; j < j1; j += 8) {
    const int n = std::min(8, j1 - j);
    for (int i = 0; i < 8; i++) {
      const float* kr = a.key(g, j + std::min(i, n - 1));
      for (int d = 0; d < D; d++) kt[d * 8 + i] = i < n ? kr[d] : 0.0f;
    }
    for (int t = 0; t < T; t++) {
      if (j >= a.keys(t)) continue;
      const float* q = qs + static_cast<int64_t>(t) * D;
      v8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
      for (int d = 0; d < D; d += 4) {
        c0 += q[d] * load(kt + d * 8);
        c1 += q[d + 1] * load(kt + (d + 1) * 8);
        c2 += q[d + 2] * load(kt + (d + 2) * 8);
        c3 += q[d + 3] * load(kt + (d + 3) * 8);
      }
      const v8 r = (c0 + c1) + (c2 + c3);
      float* out = s + static_cast<int64_t>(t) * a.S + j;
      for (int i = 0; i < n; i++) out[i] = r[i];
    }
  }
}

// An array mask on row t's scores, as MLX's fallback applies it.
inline void apply_mask(const Args& a, float* row, int g, int t) {
  const int b = g / a.Hk, h = (g % a.Hk) * a.repeats() + t / a.L, l = t % a.L;
  const int64_t base = b * a.m_b + h * a.m_h + l * a.m_l;
  if (a.mask_kind == BOOL) {
    const bool* m = static_cast<const bool*>(a.mask) + base;
    for (int j = 0; j < a.S; j++) row[j] = m[j * a.m_s] ? row[j] : -FLT_MAX;
  } else {
    const float* m = static_cast<const float*>(a.mask) + base;
    for (int j = 0; j < a.S; j++) row[j] = row[j] + m[j * a.m_s];
  }
}

// MLX's precise softmax over rows [t0, t1) of group g, in place; the running sums of up to
// four rows interleave (each still in order), which hides the adds' latency.
inline void softmax_rows(const Args& a, float* s, int g, int t0, int t1) {
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int shortest = a.S;
  for (int t = t0; t < t1; t++) {
    float* row = s + static_cast<int64_t>(t) * a.S;
    const int n = a.keys(t);
    shortest = std::min(shortest, n);
    if (a.mask_kind == BOOL || a.mask_kind == ADDITIVE) apply_mask(a, row, g, t);
    float top = -INFINITY;  // NaN sticks, as in MLX's maximum
    bool nan = false;
    for (int j = 0; j < n; j++) {
      nan |= row[j] != row[j];
      top = row[j] > top ? row[j] : top;
    }
    if (nan) top = NAN;
    for (int j = 0; j < n; j++) row[j] = exp_mlx(row[j] - top);
  }
  const int m = t1 - t0;
  const float* r[4];
  for (int u = 0; u < m; u++) r[u] = s + static_cast<int64_t>(t0 + u) * a.S;
  for (int j = 0; j < shortest; j++)
    for (int u = 0; u < m; u++) sum[u] += r[u][j];
  for (int u = 0; u < m; u++) {
    float* row = s + static_cast<int64_t>(t0 + u) * a.S;
    const int n = a.keys(t0 + u);
    for (int j = shortest; j < n; j++) sum[u] += row[j];
    const float inv = 1.0f / sum[u];
    for (int j = 0; j < n; j++) row[j] = row[j] * inv;
  }
}

// out[:, d0 : d0 + 8 * NV] of every row of group g: values [j, j + 64) stay in L1 while each
// row adds its terms for them, in order, into NV vectors.
template <int NV>
inline void values(const Args& a, const float* s, int g, int d0) {
  const int T = a.rows();
  for (int t = 0; t < T; t++)
    for (int i = 0; i < NV; i++) store(a.out + a.row_of(g, t) * a.D + d0 + 8 * i, v8{0});
  for (int j0 = 0; j0 < a.S; j0 += VALUE_CHUNK) {
    for (int t = 0; t < T; t++) {
      const int n = std::min(j0 + VALUE_CHUNK, a.keys(t));
      const float* p = s + static_cast<int64_t>(t) * a.S;
      float* o = a.out + a.row_of(g, t) * a.D + d0;
      v8 acc[NV];
      for (int i = 0; i < NV; i++) acc[i] = load(o + 8 * i);
      for (int j = j0; j < n; j++) {
        const float* vr = a.value(g, j) + d0;
        const float pj = p[j];
        for (int i = 0; i < NV; i++) acc[i] += pj * load(vr + 8 * i);
      }
      for (int i = 0; i < NV; i++) store(o + 8 * i, acc[i]);
    }
  }
}

inline void values_part(const Args& a, const float* s, int g, int part) {
  const int d0 = part * 32, nv = std::min(4, (a.D - d0) / 8);
  if (nv == 4) values<4>(a, s, g, d0);
  else if (nv == 3) values<3>(a, s, g, d0);
  else if (nv == 2) values<2>(a, s, g, d0);
  else values<1>(a, s, g, d0);
}

// Groups [g0, g1) (a KV head of a batch row each): scores, softmax, values.
inline void run_groups(const Args& a, const float* qs, float* s, int g0, int g1) {
  const int T = a.rows(), n = g1 - g0, chunks = (a.S + KEY_CHUNK - 1) / KEY_CHUNK;
  const int64_t per = static_cast<int64_t>(T) * a.S, parts = (a.D + 31) / 32;
  const bool par = per * n * a.D >= (1L << 16);  // below this, threads cost more than they save
#pragma omp parallel for schedule(static) if (par)
  for (int u = 0; u < n * chunks; u++) {
    const int g = g0 + u / chunks, j0 = (u % chunks) * KEY_CHUNK;
    score_keys(a, qs + static_cast<int64_t>(g) * T * a.D, s + (g - g0) * per, g, j0,
               std::min(a.S, j0 + KEY_CHUNK));
  }
  const int quads = (T + 3) / 4;
#pragma omp parallel for schedule(static) if (par)
  for (int u = 0; u < n * quads; u++) {
    const int g = g0 + u / quads, t0 = (u % quads) * 4;
    softmax_rows(a, s + (g - g0) * per, g, t0, std::min(T, t0 + 4));
  }
#pragma omp parallel for schedule(static) if (par)
  for (int u = 0; u < n * parts; u++) {
    const int g = g0 + u / static_cast<int>(parts);
    values_part(a, s + (g - g0) * per, g, u % static_cast<int>(parts));
  }
}

// The whole call: rows scaled as MLX scales them (scale * q), then the groups in turns that
// keep the scores under SCRATCH floats.
inline void run(const Args& a) {
  static thread_local std::vector<float> qs, s;
  const int G = a.B * a.Hk, T = a.rows(), D = a.D;
  qs.resize(static_cast<size_t>(G) * T * D);
  for (int g = 0; g < G; g++)
    for (int t = 0; t < T; t++) {
      const float* src = a.q + a.row_of(g, t) * D;
      float* dst = qs.data() + (static_cast<int64_t>(g) * T + t) * D;
      for (int d = 0; d < D; d++) dst[d] = a.scale * src[d];
    }
  const int64_t per = static_cast<int64_t>(T) * a.S;
  const int step = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(G, SCRATCH / per)));
  s.resize(static_cast<size_t>(step) * per);
  for (int g0 = 0; g0 < G; g0 += step) run_groups(a, qs.data(), s.data(), g0, std::min(G, g0 + step));
}

}  // namespace dflash_attention
