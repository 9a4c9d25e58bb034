// Few-row affine-quantized matmul (a verify's M = 2..16 rows); body for mx.fast.metal_kernel.
//
// Semantics (reference: mx.quantized_matmul(x, w, scales, biases, transpose=True), MLX's
// affine layout as mx.quantize writes it; twin: dflash_mlx/model/qmm.py::qmm_ops):
//   out[m, n] = sum_k x[m, k] * (scales[n, k / GS] * q[n, k] + biases[n, k / GS])
//   q[n, k]: BITS-bit field k % (32 / BITS) of word w[n, k / (32 / BITS)], low bits first.
//
// Each thread reads its weight words, scales and biases once and multiplies them by all M
// rows: one pass over the weights per call, whatever M (MLX's qmm re-reads per row tile).
// Per row the arithmetic is MLX's one-row kernel's (qmv_fast in mlx 0.32's quantized.h):
// lanes take 2 words (VPT values) at a time, x is pre-divided by 16^j so masked (unshifted)
// nibbles multiply it, its sum is taken in float as load_vector does (4 bits: the 4 values
// of a half-word, then into the sum; 8 bits: one at a time), a chunk adds
// scale * accum + sum * bias, and the 32 lanes' partials are reduced with simd_sum.
// tests/metal_emu/qmv_one_row.metal is that one-row kernel; the emulator checks each row
// equals it bit for bit under its assumed simd_sum order (metal_emu/metal_shim.h).
// A row's result never depends on the other rows: row m of M rows = the same row alone.
//
// Inputs (row-contiguous): x [M, K] T; w [N, K * BITS / 32] uint32; scales, biases
//   [N, K / GS] T. K a multiple of GS, M <= 16.
// Output: out [M, N] T.
// Template: T (x's dtype), BITS (4 or 8), GS (32, 64 or 128).
// Grid: (32, ceil(N / 4), 1); threadgroup (32, 2, 1): each group of 32 lanes computes 4
// output columns for all M rows (MLX's qmv_fast: 2 simdgroups of 4 results).

constexpr int ROWS = 16;                  // most rows a call takes
constexpr int COLS = 4;                   // output columns per 32 lanes
constexpr int LANES = 32;
constexpr int PACK = 32 / BITS;           // values per uint32 word
constexpr int VPT = 2 * PACK;             // values a lane takes at a time (2 words)

const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int KW = w_shape[1];                // words per output column
const int KG = scales_shape[1];           // groups per output column
const uint lane = thread_position_in_threadgroup.x;  // = the SIMD lane: 32 wide groups
const int col0 = int(thread_position_in_grid.y) * COLS;

float acc[ROWS][COLS];
for (int m = 0; m < ROWS; ++m) {
  for (int c = 0; c < COLS; ++c) {
    acc[m][c] = 0.0f;
  }
}
for (int k0 = int(lane) * VPT; k0 < K; k0 += LANES * VPT) {
  uint wq[COLS][2];
  float s[COLS];
  float b[COLS];
  for (int c = 0; c < COLS; ++c) {  // this chunk's weights: read once for every row
    const int n = metal::min(col0 + c, N - 1);
    const size_t wi = size_t(n) * KW + k0 / PACK;
    const size_t gi = size_t(n) * KG + k0 / GS;
    wq[c][0] = (col0 + c < N) ? w[wi] : 0u;
    wq[c][1] = (col0 + c < N) ? w[wi + 1] : 0u;
    s[c] = (col0 + c < N) ? float(scales[gi]) : 0.0f;
    b[c] = (col0 + c < N) ? float(biases[gi]) : 0.0f;
  }
  for (int m = 0; m < M; ++m) {
    float xt[VPT];
    float sum = 0.0f;
    const size_t xi = size_t(m) * K + k0;
    if (BITS == 4) {  // MLX's load_vector, its sums in float
      for (int i = 0; i < VPT; i += 4) {
        const float x0 = float(x[xi + i]), x1 = float(x[xi + i + 1]);
        const float x2 = float(x[xi + i + 2]), x3 = float(x[xi + i + 3]);
        sum += x0 + x1 + x2 + x3;
        xt[i] = x0;
        xt[i + 1] = x1 / 16.0f;
        xt[i + 2] = x2 / 256.0f;
        xt[i + 3] = x3 / 4096.0f;
      }
    } else {
      for (int i = 0; i < VPT; ++i) {
        xt[i] = float(x[xi + i]);
        sum += xt[i];
      }
    }
    for (int c = 0; c < COLS; ++c) {  // MLX's qdot
      float accum = 0.0f;
      if (BITS == 4) {
        for (int j = 0; j < VPT / 4; ++j) {
          const uint word = wq[c][j / 2];
          const uint h = (j % 2) ? (word >> 16) : (word & 0xffffu);
          accum += (xt[4 * j] * float(h & 0x000fu) + xt[4 * j + 1] * float(h & 0x00f0u) +
                    xt[4 * j + 2] * float(h & 0x0f00u) + xt[4 * j + 3] * float(h & 0xf000u));
        }
      } else {
        for (int i = 0; i < VPT; ++i) {
          accum += xt[i] * float((wq[c][i / 4] >> (8 * (i % 4))) & 0xffu);
        }
      }
      acc[m][c] += s[c] * accum + sum * b[c];
    }
  }
}
for (int m = 0; m < M; ++m) {  // every lane calls simd_sum: uniform control flow
  for (int c = 0; c < COLS; ++c) {
    const float total = metal::simd_sum(acc[m][c]);
    if (lane == 0 && col0 + c < N) {
      out[size_t(m) * N + col0 + c] = static_cast<T>(total);
    }
  }
}
