// Test-only: the one-row quantized matvec of plain decoding, written after MLX's qmv_fast
// (mlx 0.32, kernels/quantized.h: qmv_fast_impl, load_vector, qdot) so the emulator can say
// whether each row of metal/few_row_qmm.metal equals it bit for bit. Our own code.
//
// What is kept from qmv_fast, per row of x (each row its own threadgroups, as MLX's tid.x):
//   * 2 SIMD-groups of 4 output columns per threadgroup; lane l takes VPT = 2 words' values
//     at k = l * VPT, then steps by 32 * VPT (lanes past K take nothing: MLX's tail block).
//   * load_vector: x into float, pre-divided by 16^j for 4 bits; its sum in float: 4 bits
//     adds the 4 values of a half-word, then adds that to the sum; 8 bits adds one at a time.
//   * qdot: accum over the masked (unshifted) fields, then scale * accum + sum * bias.
//   * simd_sum of each column's lane partials, lane 0 stores static_cast<T>.
// Differences that cannot change a stored value: columns past N reuse column N - 1 (MLX:
// partial_rows) and every SIMD-group runs to the end, as the emulated simd_sum needs.
//
// Inputs: x [M, K] T; w [N, K * BITS / 32] uint32; scales, biases [N, K / GS] T.
// Output: out [M, N] T. Template: T, BITS (4 or 8), GS.
// Grid: (32, 2 * ceil(N / 8), M); threadgroup (32, 2, 1).

constexpr int RESULTS = 4;
constexpr int PACK = 32 / BITS;
constexpr int VPT = 2 * PACK;
constexpr int BLOCK = 32 * VPT;

const int K = x_shape[1];
const int N = w_shape[0];
const int KW = w_shape[1];
const int KG = scales_shape[1];
const uint lid = thread_index_in_simdgroup;
const int row = int(threadgroup_position_in_grid.z);
const int out0 = int(threadgroup_position_in_grid.y) * 2 * RESULTS +
                 int(simdgroup_index_in_threadgroup) * RESULTS;

float result[RESULTS] = {0.0f, 0.0f, 0.0f, 0.0f};
for (int k = int(lid) * VPT; k < K; k += BLOCK) {
  float xt[VPT];
  float sum = 0.0f;
  const size_t xi = size_t(row) * K + k;
  if (BITS == 4) {
    for (int i = 0; i < VPT; i += 4) {
      sum += float(x[xi + i]) + float(x[xi + i + 1]) + float(x[xi + i + 2]) +
             float(x[xi + i + 3]);
      xt[i] = float(x[xi + i]);
      xt[i + 1] = float(x[xi + i + 1]) / 16.0f;
      xt[i + 2] = float(x[xi + i + 2]) / 256.0f;
      xt[i + 3] = float(x[xi + i + 3]) / 4096.0f;
    }
  } else {
    for (int i = 0; i < VPT; ++i) {
      sum += float(x[xi + i]);
      xt[i] = float(x[xi + i]);
    }
  }
  for (int r = 0; r < RESULTS; ++r) {
    const int n = metal::min(out0 + r, N - 1);
    const size_t wi = size_t(n) * KW + k / PACK;
    const float s = float(scales[size_t(n) * KG + k / GS]);
    const float b = float(biases[size_t(n) * KG + k / GS]);
    float accum = 0.0f;
    if (BITS == 4) {
      for (int j = 0; j < VPT / 4; ++j) {
        const uint word = w[wi + j / 2];
        const uint h = (j % 2) ? (word >> 16) : (word & 0xffffu);
        accum += (xt[4 * j] * float(h & 0x000fu) + xt[4 * j + 1] * float(h & 0x00f0u) +
                  xt[4 * j + 2] * float(h & 0x0f00u) + xt[4 * j + 3] * float(h & 0xf000u));
      }
    } else {
      for (int i = 0; i < VPT; ++i) {
        accum += xt[i] * float((w[wi + i / 4] >> (8 * (i % 4))) & 0xffu);
      }
    }
    result[r] += s * accum + sum * b;
  }
}
for (int r = 0; r < RESULTS; ++r) {
  const float total = simd_sum(result[r]);
  if (lid == 0 && out0 + r < N) {
    out[size_t(row) * N + out0 + r] = static_cast<T>(total);
  }
}
