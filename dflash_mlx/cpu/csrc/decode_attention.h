// Attention for decode widths (a plain step's one query row, a verify's few) on MLX's CPU
// backend, reading the KV cache's keys and values where they lie.
//
// MLX's CPU fallback for scaled_dot_product_attention copies a cache's sliced K/V for every
// layer and step, multiplies each query head by its KV head on its own (a GQA model reads
// its keys once per query head), builds the causal mask as an array, and hands
// probabilities @ values over more than 1,024 keys to OpenBLAS, whose sums for one row
// depend on how many rows are multiplied with it. Here every sum behind one output element
// runs in an order fixed by that row alone:
//   score[j] = dot(scale * q, k[j]), one chain over d in order;
//   p        = MLX's precise softmax (max; exp_mlx(s - max); a running sum over j in order;
//              times 1 / sum) over the row's keys: all S (a mask applied MLX's way), or under
//              the causal mask its first S - L + l + 1 (the rest would add exact zeros);
//   out[d]   = the sum over j, in order, of p[j] * v[j][d].
// Products are added by fused multiply-adds where the CPU has them (the same instruction in
// every call, so still one order per row).
// So a row has the same bits alone (a plain step) as among others (a verify), at any context
// length. Threads split keys (scores), rows (softmax) or output columns (values), never a sum.
// Included by exact_ops.cpp; built with -ffp-contract=off and OpenMP.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <vector>

#include "exp_mlx.h"

#if defined(__FMA__)
#include <immintrin.h>
#endif

namespace dflash_attention {

enum MaskKind { NONE = 0, CAUSAL = 1, BOOL = 2, ADDITIVE = 3 };
constexpr int MAX_ROWS = 16;     // query rows per call: decode widths (small_gemm.MAX_ROWS)
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

// acc + x * y, fused where the CPU can (the file is built with -ffp-contract=off, so
// nothing else is fused behind our back).
inline v8 madd(v8 acc, float x, v8 y) {
#if defined(__FMA__)
  return reinterpret_cast<v8>(_mm256_fmadd_ps(_mm256_set1_ps(x), reinterpret_cast<__m256>(y),
                                              reinterpret_cast<__m256>(acc)));
#else
  return acc + x * y;
#endif
}

// Scores of keys [j, j + KJ) for rows [8 v0, 8 (v0 + RV)) of group g. The rows are the 8
// lanes (qt is [D, Tp]: the scaled queries transposed), so each score is one chain over d in
// order; RV row vectors times KJ keys keep eight chains in flight for the FMA units.
template <int RV, int KJ>
inline void score_block(const Args& a, const float* qt, int Tp, float* s, int g, int v0, int j) {
  v8 c[RV][KJ] = {};
  const float* kr[KJ];
  for (int u = 0; u < KJ; u++) kr[u] = a.key(g, j + u);
  for (int d = 0; d < a.D; d++) {
    v8 q[RV];
    for (int r = 0; r < RV; r++) q[r] = load(qt + int64_t{d} * Tp + (v0 + r) * 8);
    for (int u = 0; u < KJ; u++)
      for (int r = 0; r < RV; r++) c[r][u] = madd(c[r][u], kr[u][d], q[r]);
  }
  const int T = a.rows();
  for (int r = 0; r < RV; r++)
    for (int i = 0, t = (v0 + r) * 8; i < 8 && t < T; i++, t++)
      for (int u = 0; u < KJ; u++) s[int64_t{t} * a.S + j + u] = c[r][u][i];
}

template <int RV, int KJ>
inline void score_run(const Args& a, const float* qt, int Tp, float* s, int g, int v0, int j,
                     int j1) {
  for (; j + KJ <= j1; j += KJ) score_block<RV, KJ>(a, qt, Tp, s, g, v0, j);
  for (; j < j1; j++) score_block<RV, 1>(a, qt, Tp, s, g, v0, j);
}

// Scores of keys [j0, j1) for every row of group g (a row's keys past its own are scored
// and never read).
inline void score_keys(const Args& a, const float* qt, float* s, int g, int j0, int j1) {
  const int Tp = (a.rows() + 7) / 8 * 8;
  for (int v0 = 0; v0 < Tp / 8; v0 += 4) {
    const int rv = std::min(4, Tp / 8 - v0);
    if (rv == 1) score_run<1, 8>(a, qt, Tp, s, g, v0, j0, j1);
    else if (rv == 2) score_run<2, 4>(a, qt, Tp, s, g, v0, j0, j1);
    else if (rv == 3) score_run<3, 2>(a, qt, Tp, s, g, v0, j0, j1);
    else score_run<4, 2>(a, qt, Tp, s, g, v0, j0, j1);
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

// The largest of row[0, n), NaN if any is (as MLX's maximum), in 8 lanes (a maximum is
// exact in any order; the sign of a zero maximum changes no exp(x - max)).
inline float row_max(const float* row, int n) {
  v8 top = v8{} - INFINITY;
  v8 nan = {};
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 x = load(row + j);
    nan = x != x ? x : nan;
    top = x > top ? x : top;
  }
  float m = -INFINITY;
  bool any_nan = false;
  for (int i = 0; i < 8; i++) {
    any_nan |= nan[i] != nan[i];
    m = top[i] > m ? top[i] : m;
  }
  for (; j < n; j++) {
    any_nan |= row[j] != row[j];
    m = row[j] > m ? row[j] : m;
  }
  return any_nan ? NAN : m;
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
    float top = row_max(row, n);
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

// Terms [j0, j1) of out[d0 : d0 + 8 * NV] for R rows (R = 2: eight chains for the FMA
// units; each row's terms still in order, as alone).
template <int NV, int R>
inline void add_terms(const Args& a, const float* const* p, float* const* o, int g, int d0,
                      int j0, int j1) {
  v8 acc[R][NV];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < NV; i++) acc[r][i] = load(o[r] + 8 * i);
  for (int j = j0; j < j1; j++) {
    const float* vr = a.value(g, j) + d0;
    for (int i = 0; i < NV; i++) {
      const v8 x = load(vr + 8 * i);
      for (int r = 0; r < R; r++) acc[r][i] = madd(acc[r][i], p[r][j], x);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < NV; i++) store(o[r] + 8 * i, acc[r][i]);
}

// out[:, d0 : d0 + 8 * NV] of every row of group g: values [j, j + 64) stay in L1 while the
// rows, two at a time, add their terms for them.
template <int NV>
inline void values(const Args& a, const float* s, int g, int d0) {
  const int T = a.rows();
  for (int t = 0; t < T; t++)
    for (int i = 0; i < NV; i++) store(a.out + a.row_of(g, t) * a.D + d0 + 8 * i, v8{0});
  for (int j0 = 0; j0 < a.S; j0 += VALUE_CHUNK) {
    for (int t = 0; t < T; t += 2) {
      const int m = std::min(2, T - t);
      const float* p[2];
      float* o[2];
      int end[2];
      for (int u = 0; u < m; u++) {
        p[u] = s + int64_t{t + u} * a.S;
        o[u] = a.out + a.row_of(g, t + u) * a.D + d0;
        end[u] = std::max(j0, std::min(j0 + VALUE_CHUNK, a.keys(t + u)));
      }
      const int both = m == 2 ? std::min(end[0], end[1]) : j0;
      if (both > j0) add_terms<NV, 2>(a, p, o, g, d0, j0, both);
      for (int u = 0; u < m; u++)
        if (end[u] > both) add_terms<NV, 1>(a, p + u, o + u, g, d0, both, end[u]);
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
  const int T = a.rows(), Tp = (T + 7) / 8 * 8, n = g1 - g0, chunks = (a.S + KEY_CHUNK - 1) / KEY_CHUNK;
  const int64_t per = static_cast<int64_t>(T) * a.S, parts = (a.D + 31) / 32;
  const bool par = per * n * a.D >= (1L << 16);  // below this, threads cost more than they save
#pragma omp parallel for schedule(static) if (par)
  for (int u = 0; u < n * chunks; u++) {
    const int g = g0 + u / chunks, j0 = (u % chunks) * KEY_CHUNK;
    score_keys(a, qs + static_cast<int64_t>(g) * Tp * a.D, s + (g - g0) * per, g, j0,
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
  const int Tp = (T + 7) / 8 * 8;  // rows padded to whole vectors (zero lanes)
  qs.assign(static_cast<size_t>(G) * Tp * D, 0.0f);
  for (int g = 0; g < G; g++)  // [G, D, Tp]: each group's rows transposed
    for (int t = 0; t < T; t++) {
      const float* src = a.q + a.row_of(g, t) * D;
      float* dst = qs.data() + static_cast<int64_t>(g) * Tp * D + t;
      for (int d = 0; d < D; d++) dst[int64_t{d} * Tp] = a.scale * src[d];
    }
  const int64_t per = static_cast<int64_t>(T) * a.S;
  const int step = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(G, SCRATCH / per)));
  s.resize(static_cast<size_t>(step) * per);
  for (int g0 = 0; g0 < G; g0 += step) run_groups(a, qs.data(), s.data(), g0, std::min(G, g0 + step));
}

}  // namespace dflash_attention
