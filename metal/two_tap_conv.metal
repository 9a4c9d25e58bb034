// Fused dynamic two-tap depthwise conv, one side (docs/algorithm.md §2.5); body for
// mx.fast.metal_kernel.
//
// Semantics (reference: dflash_mlx/conv.py::two_tap_conv_ops):
//   k[b, t, j, c] = base[j, c] + dyn[b, t, j, c / (H / G)]
//   out[b, t, c]  = sum_j k[b, t, j, c] * x[b, t - j, c],  term dropped when t < j
//   i.e. taps never reach into an earlier block. Accumulation in float32, one rounding to T.
//
// One block per b: the launch views the [B, L, H] rows as [B * L / block, block, H], so the
// block width is read from x's shape and one compiled library serves every width.
//
// Inputs  (row-contiguous; any of float32 / float16 / bfloat16, independently):
//   x    [NB, W, H]        sublayer input or output, NB blocks of W rows
//   base [TAPS, H]         base kernel of this side
//   dyn  [NB, W, TAPS, G]  per-group dynamic coefficients, G divides H
// Outputs:
//   out  [NB, W, H]        dtype T
// Template parameters:
//   T      output dtype (the dtype of x)
//   TAPS   taps per side (2 in released checkpoints)
// Grid: (H, W, NB) threads, one thread per output element, no threadgroup memory, no
// barriers. Threadgroup: (min(H, 256), 1, 1); any shape works.

const uint c = thread_position_in_grid.x;  // channel
const uint t = thread_position_in_grid.y;  // row inside its block
const uint b = thread_position_in_grid.z;  // block
const int W = x_shape[1];                  // the block width
const int H = x_shape[2];
const int G = dyn_shape[3];
if (c >= uint(H) || t >= uint(W)) {
  return;
}
const uint gi = c / uint(H / G);                   // dynamic group of channel c
const size_t row = size_t(b) * W + t;              // flat (b, t)
const size_t dyn_row = row * TAPS * G + gi;        // dyn[b, t, 0, gi]

float acc = (float(base[c]) + float(dyn[dyn_row])) * float(x[row * H + c]);
for (int j = 1; j < TAPS; ++j) {
  const float k = float(base[size_t(j) * H + c]) + float(dyn[dyn_row + size_t(j) * G]);
  const float term = (t >= uint(j)) ? k * float(x[(row - j) * H + c]) : 0.0f;
  acc = acc + term;
}
out[row * H + c] = static_cast<T>(acc);
