// DFlash 2 path selector, one launch for the whole batch (docs/algorithm.md §3); body for
// mx.fast.metal_kernel. Reference: dflash_mlx/selector.py::select_path_ops.
//
// For every batch row b, walk the draft rows t = 0..L-1 from the anchor:
//   prev_tok = anchor[b] for t = 0, else cand[b, t-1, choice[t-1]]
//   s[k]     = U[b, t, k] + sum_r (A[prev_tok, r] * g[b, t, r]) * Bc[cand[b, t, k], r]   (fp32)
//   greedy : choice[t] = argmax_k s[k], ties to the lowest k
//   sampled: q[b, t, :] = softmax(s / T); choice[t] = #{k : cumsum(q)[k] <= u[b, t]},
//            clipped to K - 1 (inverse CDF with the pre-drawn uniform)
// Only the lattice row S_t(prev, .) that the walk visits is scored: the walk never reads the
// others, so the [L, K, K] lattice is never materialised.
//
// Inputs (row-contiguous):
//   U        [B, L, K]  unary scores (float32 / float16 / bfloat16)
//   cand     [B, L, K]  candidate token ids (uint32 or int32)
//   anchor   [B]        anchor token ids (uint32 or int32)
//   g        [B, L, R]  selector gates
//   A, Bc    [V, R]     predecessor / successor codebooks (any float dtype)
//   uniforms [B, L]     pre-drawn U(0, 1) numbers (read only when SAMPLE); [1] dummy otherwise
//   params   [1]        float32 temperature T (read only when SAMPLE)
// Outputs:
//   path     [B, L]     int32 chosen candidate index per row
//   q        [B, L, K]  float32 proposal rows (written only when SAMPLE; [1] otherwise)
// Template parameters:
//   K       candidates per row (top-k); sizes the threadgroup arrays
//   W       lanes per candidate that split the rank-R dot product (K * W <= 1024)
//   SAMPLE  false: greedy walk; true: sampled walk writing q
// Grid: (K * W, B, 1); threadgroup: (K * W, 1, 1), i.e. one threadgroup per batch row.
// Thread lid = k * W + w scores candidate k over ranks r = w, w + W, ... (coalesced across
// the W lanes). Per draft row: partial sums -> barrier -> lane 0 of each candidate adds its W
// partials in lane order and U -> barrier -> every thread walks the K scores itself (identical
// arithmetic, so all threads agree on the choice without another barrier). Threadgroup
// memory: (K * W + K) floats. No SIMD-group functions, no atomics.

const uint lid = thread_position_in_threadgroup.x;
const uint b = threadgroup_position_in_grid.y;
const uint k = lid / uint(W);
const uint w = lid % uint(W);
const int L = g_shape[1];
const int R = g_shape[2];

threadgroup float partial[K * W];
threadgroup float score[K];

uint prev_tok = uint(anchor[b]);
for (int t = 0; t < L; ++t) {
  const size_t row = size_t(b) * L + t;  // flat (b, t)
  const uint tok = uint(cand[row * K + k]);
  const size_t a_off = size_t(prev_tok) * R;  // A[prev_tok, :]
  const size_t b_off = size_t(tok) * R;       // Bc[tok, :]
  const size_t g_off = row * R;               // g[b, t, :]
  float acc = 0.0f;
  for (int r = int(w); r < R; r += W) {
    acc += (float(A[a_off + r]) * float(g[g_off + r])) * float(Bc[b_off + r]);
  }
  partial[lid] = acc;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  if (w == 0) {
    float pair = 0.0f;
    for (int i = 0; i < W; ++i) {
      pair += partial[k * W + i];
    }
    score[k] = float(U[row * K + k]) + pair;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

  int choice = 0;
  if (SAMPLE) {
    const float temp = params[0];
    float z[K];
    float m = -INFINITY;
    for (int i = 0; i < K; ++i) {
      z[i] = score[i] / temp;
      m = metal::max(m, z[i]);
    }
    float total = 0.0f;
    for (int i = 0; i < K; ++i) {
      z[i] = metal::exp(z[i] - m);
      total += z[i];
    }
    const float u = float(uniforms[row]);
    float cdf = 0.0f;
    for (int i = 0; i < K; ++i) {
      cdf += z[i] / total;
      choice += (cdf <= u) ? 1 : 0;
    }
    choice = metal::min(choice, K - 1);
    if (w == 0) {
      q[row * K + k] = z[k] / total;
    }
  } else {
    float best = score[0];
    for (int i = 1; i < K; ++i) {
      if (score[i] > best) {
        best = score[i];
        choice = i;
      }
    }
  }
  if (lid == 0) {
    path[row] = choice;
  }
  prev_tok = uint(cand[row * K + choice]);
}
