// Exact, vectorised twins of two MLX CPU ops whose exp dominates a decode step's
// elementwise work: silu(g) * u (the SwiGLU MLP) and the last-axis softmax (attention).
//
// MLX's Linux wheel evaluates exp one element at a time, with each of its polynomial's six
// fused multiply-adds a call to libm's fmaf (~18 ns an element here). These kernels run
// the same algorithm (mlx/backend/cpu/simd/math.h: Cephes' 2^x polynomial, the same
// constants, each step an IEEE fma) in a loop the compiler vectorises, built with
// -ffp-contract=off so no other product is fused: every output has MLX's bits. The
// softmax keeps MLX's order where order matters (its normaliser is a running sum).
//
// Built on first use by dflash_mlx/exact_ops.py against the installed MLX and nanobind.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// exp(x) as MLX's CPU backend computes it (simd::exp with one lane).
inline float exp_mlx(float x0) {
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

// MLX's Sigmoid, then its two products: (g * sigmoid(g)) * u.
void silu_mul_rows(const float* __restrict g, const float* __restrict u, float* __restrict out,
                   size_t n) {
  for (size_t i = 0; i < n; i++) {
    float x = g[i];
    float y = 1.0f / (1.0f + exp_mlx(std::fabs(x)));
    float s = x < 0.0f ? y : 1.0f - y;
    out[i] = (x * s) * u[i];
  }
}

// MLX's precise float32 softmax over rows of m (mlx/backend/cpu/softmax.cpp, one lane).
void softmax_rows(const float* __restrict in, float* __restrict out, size_t rows, size_t m) {
  for (size_t r = 0; r < rows; r++, in += m, out += m) {
    float mx_ = -INFINITY;  // NaN sticks, as in MLX's maximum
    bool nan = false;
    for (size_t i = 0; i < m; i++) {
      nan |= in[i] != in[i];
      mx_ = in[i] > mx_ ? in[i] : mx_;
    }
    if (nan) mx_ = NAN;
    for (size_t i = 0; i < m; i++) out[i] = exp_mlx(in[i] - mx_);
    float sum = 0.0f;  // in order: MLX sums one element at a time
    for (size_t i = 0; i < m; i++) sum += out[i];
    float inv = 1.0f / sum;
    for (size_t i = 0; i < m; i++) out[i] = out[i] * inv;
  }
}

bool on_cpu_f32(const mx::array& a, const mx::StreamOrDevice& s) {
  return a.dtype() == mx::float32 && mx::to_stream(s).device.type == mx::Device::DeviceType::cpu;
}

// An input's elements in row-major order: its buffer when it is row-contiguous (always, in
// a decode step: matmul and where outputs), else gathered through its strides.
struct Dense {
  const float* data;
  bool contiguous;
  mx::Shape shape;
  mx::Strides strides;
  explicit Dense(const mx::array& a)
      : data(a.data<float>()),
        contiguous(a.flags().row_contiguous),
        shape(a.shape()),
        strides(a.strides()) {}
  const float* get(std::vector<float>& buf, size_t n) const {
    if (contiguous) return data;
    buf.resize(n);
    for (size_t i = 0; i < n; i++) {
      size_t rest = i;
      int64_t loc = 0;
      for (int d = static_cast<int>(shape.size()) - 1; d >= 0; d--) {
        loc += static_cast<int64_t>(rest % shape[d]) * strides[d];
        rest /= shape[d];
      }
      buf[i] = data[loc];
    }
    return buf.data();
  }
};

// What both primitives share: CPU only, one output shaped like the first input, no state.
class CpuElementwise : public mx::Primitive {
 public:
  explicit CpuElementwise(mx::Stream s) : mx::Primitive(s) {}
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("[") + name() + "] CPU only");
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return std::string(other.name()) == name();
  }

 protected:
  // Allocates the output and registers the arrays with the stream's encoder.
  mx::cpu::CommandEncoder& prepare(const std::vector<mx::array>& in, mx::array& out) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    return enc;
  }
};

class SiluMul : public CpuElementwise {
 public:
  using CpuElementwise::CpuElementwise;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto& out = outs[0];
    prepare(in, out).dispatch([g = Dense(in[0]), u = Dense(in[1]), o = out.data<float>(), n = out.size()]() {
      std::vector<float> gb, ub;
      silu_mul_rows(g.get(gb, n), u.get(ub, n), o, n);
    });
  }
  const char* name() const override { return "DflashSiluMul"; }
};

class Softmax : public CpuElementwise {
 public:
  using CpuElementwise::CpuElementwise;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto& out = outs[0];
    size_t m = in[0].shape().back();
    prepare(in, out).dispatch([x = Dense(in[0]), o = out.data<float>(), m, n = out.size()]() {
      std::vector<float> xb;
      softmax_rows(x.get(xb, n), o, n / m, m);
    });
  }
  const char* name() const override { return "DflashSoftmax"; }
};

// silu(g) * u; MLX's own ops where the kernel does not apply (other dtypes, shapes, GPU).
mx::array exact_silu_mul(const mx::array& g, const mx::array& u) {
  mx::StreamOrDevice s = {};
  if (!on_cpu_f32(g, s) || u.dtype() != mx::float32 || g.shape() != u.shape() ||
      g.size() == 0) {
    return mx::multiply(mx::multiply(g, mx::sigmoid(g, s), s), u, s);
  }
  auto st = mx::to_stream(s);
  std::vector<mx::array> in = {g, u};
  return mx::array(g.shape(), mx::float32, std::make_shared<SiluMul>(st), std::move(in));
}

// mx.softmax(x, axis=-1, precise=True); MLX's own op where the kernel does not apply.
mx::array exact_softmax(const mx::array& x) {
  mx::StreamOrDevice s = {};
  if (!on_cpu_f32(x, s) || x.ndim() == 0 || x.size() == 0) {
    return mx::softmax(x, std::vector<int>{-1}, true, s);
  }
  auto st = mx::to_stream(s);
  std::vector<mx::array> in = {x};
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(st), std::move(in));
}

// mx.fast.scaled_dot_product_attention as MLX's CPU backend evaluates it (the op graph of
// its fallback in mlx/fast.cpp, op for op), with the softmax above: the same bits.
mx::array exact_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                    float scale, bool causal, std::optional<mx::array> mask) {
  mx::StreamOrDevice s = {};
  int n_q_heads = queries.shape(1), n_kv_heads = keys.shape(1);
  int n_repeats = n_q_heads / n_kv_heads;
  auto q = mx::multiply(mx::array(scale, queries.dtype()), queries, s);
  auto k = keys, v = values;
  if (n_repeats > 1) {
    q = mx::unflatten(q, 1, {n_kv_heads, n_repeats}, s);
    k = mx::expand_dims(k, 2, s);
    v = mx::expand_dims(v, 2, s);
  }
  auto scores = mx::matmul(q, mx::swapaxes(k, -1, -2, s), s);  // [B, Hk, R, L, S]
  if (causal || mask) {
    mx::array m = causal ? mx::array(false) : *mask;
    if (causal) {
      int kl = k.shape(-2), ql = q.shape(-2), offset = kl - ql;
      auto qi = mx::expand_dims(mx::arange(offset, ql + offset, s), 1, s);
      auto ki = mx::expand_dims(mx::arange(0, kl, s), 0, s);
      m = mx::greater_equal(qi, ki, s);
    } else {
      if (m.dtype() != mx::bool_) m = mx::astype(m, queries.dtype(), s);
      auto shape = queries.shape();
      shape.back() = keys.shape(-2);
      m = mx::broadcast_to(m, shape, s);
      if (n_repeats > 1 && m.ndim() >= 3) {
        m = m.shape(-3) == 1 ? mx::expand_dims(m, -3, s)
                             : mx::unflatten(m, -3, {n_kv_heads, n_repeats}, s);
      }
    }
    if (m.dtype() == mx::bool_) {
      auto low = mx::array(mx::finfo(scores.dtype()).min, scores.dtype());
      scores = mx::where(m, scores, low, s);
    } else {
      scores = mx::add(scores, m, s);
    }
  }
  auto out = mx::matmul(exact_softmax(scores), v, s);
  return n_repeats > 1 ? mx::flatten(out, 1, 2, s) : out;
}

// exp over a float32 host buffer, element by element (the tests' exhaustive check).
void exp_buffer(uintptr_t src, uintptr_t dst, size_t n) {
  auto x = reinterpret_cast<const float*>(src);
  auto y = reinterpret_cast<float*>(dst);
  for (size_t i = 0; i < n; i++) y[i] = exp_mlx(x[i]);
}

}  // namespace

NB_MODULE(_dflash_exact_ops, m) {
  m.def("silu_mul", &exact_silu_mul, "silu(g) * u with MLX's bits");
  m.def("softmax", &exact_softmax, "softmax over the last axis with MLX's bits");
  m.def("attention", &exact_attention, "scaled dot-product attention with MLX's CPU bits");
  m.def("exp_buffer", &exp_buffer, "exp over n float32 values at src into dst");
}
