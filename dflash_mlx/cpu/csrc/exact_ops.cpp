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
// The drafter's RMSNorm, two-tap conv and softmax of powers of 2 (draft_kernels.h) are MLX
// primitives here too: one graph op each where the compiled step had 3, ~11 and 5.
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
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "decode_attention.h"
#include "draft_kernels.h"
#include "exp_mlx.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

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

class RmsNorm : public CpuElementwise {
 public:
  RmsNorm(mx::Stream s, float eps) : CpuElementwise(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto& out = outs[0];
    size_t d = in[0].shape().back();
    prepare(in, out).dispatch(
        [x = Dense(in[0]), w = Dense(in[1]), o = out.data<float>(), n = out.size(), d, eps = eps_]() {
          std::vector<float> xb, wb;
          rms_norm_rows(x.get(xb, n), w.get(wb, d), o, n / d, d, eps);
        });
  }
  const char* name() const override { return "DflashRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const RmsNorm*>(&other);
    return o && o->eps_ == eps_;
  }

 private:
  float eps_;
};

class TwoTap : public CpuElementwise {
 public:
  TwoTap(mx::Stream s, int side) : CpuElementwise(s), side_(side) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto& out = outs[0];
    const size_t L = in[0].shape(-2), H = in[0].shape(-1), B = in[0].size() / (L * H);
    const size_t G = in[2].shape(-1);
    prepare(in, out).dispatch([x = Dense(in[0]), b = Dense(in[1]), d = Dense(in[2]),
                               o = out.data<float>(), B, L, H, G, side = side_]() {
      std::vector<float> xb, bb, db;
      two_tap_rows(x.get(xb, B * L * H), b.get(bb, 4 * H), d.get(db, B * L * 4 * G), o, B, L,
                   H, G, side);
    });
  }
  const char* name() const override { return "DflashTwoTap"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const TwoTap*>(&other);
    return o && o->side_ == side_;
  }

 private:
  int side_;
};

class Pow2Softmax : public CpuElementwise {
 public:
  using CpuElementwise::CpuElementwise;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto& out = outs[0];
    size_t m = in[0].shape().back();
    prepare(in, out).dispatch([x = Dense(in[0]), o = out.data<float>(), m, n = out.size()]() {
      std::vector<float> xb;
      pow2_softmax_rows(x.get(xb, n), o, n / m, m);
    });
  }
  const char* name() const override { return "DflashPow2Softmax"; }
};

// Keys or values as the kernel reads them: in place when each row's d is contiguous (a KV
// cache's slice), else gathered row-major.
struct Rows {
  const float* data;
  int64_t b, h, s;
  std::vector<float> buf;
  Rows(const mx::array& a) {
    if (a.strides().back() == 1) {
      data = a.data<float>();
      b = a.strides()[0], h = a.strides()[1], s = a.strides()[2];
    } else {
      data = Dense(a).get(buf, a.size());
      s = a.shape(3), h = s * a.shape(2), b = h * a.shape(1);
    }
  }
};

// Attention for decode widths (decode_attention.h): q, k, v and an optional mask broadcast
// to [B, H, L, S]; each row's bits depend on that row alone.
class DecodeAttention : public CpuElementwise {
 public:
  DecodeAttention(mx::Stream s, float scale, int kind)
      : CpuElementwise(s), scale_(scale), kind_(kind) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto& out = outs[0];
    auto& enc = prepare(in, out);
    const mx::array q = in[0], k = in[1], v = in[2];
    std::optional<mx::array> mask;
    if (in.size() > 3) mask = in[3];
    enc.dispatch([q, k, v, mask, o = out.data<float>(), scale = scale_, kind = kind_]() {
      dflash_attention::Args a{};
      a.B = q.shape(0), a.H = q.shape(1), a.L = q.shape(2), a.D = q.shape(3);
      a.Hk = k.shape(1), a.S = k.shape(2), a.scale = scale, a.mask_kind = kind;
      std::vector<float> qb;
      a.q = Dense(q).get(qb, q.size());
      Rows kr(k), vr(v);
      a.k = kr.data, a.k_b = kr.b, a.k_h = kr.h, a.k_s = kr.s;
      a.v = vr.data, a.v_b = vr.b, a.v_h = vr.h, a.v_s = vr.s;
      if (mask) {
        a.mask = kind == dflash_attention::BOOL ? static_cast<const void*>(mask->data<bool>())
                                                : static_cast<const void*>(mask->data<float>());
        const auto& st = mask->strides();
        a.m_b = st[0], a.m_h = st[1], a.m_l = st[2], a.m_s = st[3];
      }
      a.out = o;
      dflash_attention::run(a);
    });
  }
  const char* name() const override { return "DflashDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const DecodeAttention*>(&other);
    return o && o->scale_ == scale_ && o->kind_ == kind_;
  }

 private:
  float scale_;
  int kind_;
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

// mx.fast.rms_norm(x, w, eps) over the last axis; MLX's own op where the kernel does not apply.
mx::array exact_rms_norm(const mx::array& x, const mx::array& w, float eps) {
  mx::StreamOrDevice s = {};
  if (!on_cpu_f32(x, s) || w.dtype() != mx::float32 || x.ndim() == 0 || x.size() == 0 ||
      w.ndim() != 1 || w.shape(0) != x.shape().back()) {
    return mx::fast::rms_norm(x, w, eps, s);
  }
  auto st = mx::to_stream(s);
  std::vector<mx::array> in = {x, w};
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(st, eps), std::move(in));
}

// One side (0 or 1) of the two-tap conv over one block: x [B, L, H] or [L, H], base [2, 2, H],
// d [B, L, 2, 2, G] or [L, 2, 2, G]; raises where the kernel does not apply (the caller then
// runs its ops).
mx::array exact_two_tap(const mx::array& x, const mx::array& b, const mx::array& d, int side) {
  mx::StreamOrDevice s = {};
  const bool f32 = on_cpu_f32(x, s) && b.dtype() == mx::float32 && d.dtype() == mx::float32;
  const int nd = x.ndim();
  bool ok = f32 && (nd == 2 || nd == 3) && d.ndim() == nd + 2 && (side == 0 || side == 1) &&
            b.ndim() == 3 && b.shape(0) == 2 && b.shape(1) == 2 && x.size() > 0;
  for (int i = 0; ok && i < nd - 1; i++) ok = d.shape(i) == x.shape(i);
  ok = ok && b.shape(2) == x.shape(-1) && d.shape(-3) == 2 && d.shape(-2) == 2 &&
       d.shape(-1) >= 1 && x.shape(-1) % d.shape(-1) == 0;
  if (!ok) throw std::invalid_argument("two_tap: shapes or dtypes the kernel does not take");
  auto st = mx::to_stream(s);
  std::vector<mx::array> in = {x, b, d};
  return mx::array(x.shape(), mx::float32, std::make_shared<TwoTap>(st, side), std::move(in));
}

// p = 2^(x - max) / sum over the last axis as cpu/fastmath.py's attention computes it; raises
// where the kernel does not apply (the caller then runs its ops).
mx::array exact_pow2_softmax(const mx::array& x) {
  mx::StreamOrDevice s = {};
  if (!on_cpu_f32(x, s) || x.ndim() == 0 || x.size() == 0) {
    throw std::invalid_argument("pow2_softmax: not float32 on the CPU");
  }
  auto st = mx::to_stream(s);
  std::vector<mx::array> in = {x};
  return mx::array(x.shape(), mx::float32, std::make_shared<Pow2Softmax>(st), std::move(in));
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

// Whether the decode kernel takes this call: few query rows (a decode step or a verify),
// float32 on the CPU, head dims the kernel's vectors divide, at least as many keys as queries.
bool decode_fits(const mx::array& q, const mx::array& k, const mx::array& v, bool causal) {
  if (!on_cpu_f32(q, {}) || k.dtype() != mx::float32 || v.dtype() != mx::float32) return false;
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape()) return false;
  const int L = q.shape(2), D = q.shape(3), S = k.shape(2);
  return L >= 1 && L <= dflash_attention::MAX_ROWS && D % 8 == 0 && k.shape(3) == D &&
         q.shape(0) == k.shape(0) && k.shape(1) >= 1 && q.shape(1) % k.shape(1) == 0 && S >= 1 &&
         (!causal || S >= L);
}

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                           bool causal, std::optional<mx::array> mask) {
  mx::StreamOrDevice s = {};
  std::vector<mx::array> in = {q, k, v};
  int kind = causal ? dflash_attention::CAUSAL : dflash_attention::NONE;
  if (mask) {
    mx::array m = *mask;
    kind = m.dtype() == mx::bool_ ? dflash_attention::BOOL : dflash_attention::ADDITIVE;
    if (kind == dflash_attention::ADDITIVE) m = mx::astype(m, mx::float32, s);
    auto shape = q.shape();
    shape.back() = k.shape(2);
    in.push_back(mx::broadcast_to(m, shape, s));
  }
  auto prim = std::make_shared<DecodeAttention>(mx::to_stream(s), scale, kind);
  return mx::array(q.shape(), mx::float32, std::move(prim), std::move(in));
}

// Decode widths (decode_fits): the kernel above, each row's bits its own. Otherwise
// mx.fast.scaled_dot_product_attention as MLX's CPU backend evaluates it (the op graph of
// its fallback in mlx/fast.cpp, op for op), with the softmax above: the same bits.
mx::array exact_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                    float scale, bool causal, std::optional<mx::array> mask) {
  mx::StreamOrDevice s = {};
  if (decode_fits(queries, keys, values, causal)) {
    return decode_attention(queries, keys, values, scale, causal, mask);
  }
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
  m.def("rms_norm", &exact_rms_norm, "mx.fast.rms_norm over the last axis with MLX's bits");
  m.def("two_tap", &exact_two_tap, "one side of the two-tap conv over one block");
  m.def("pow2_softmax", &exact_pow2_softmax, "the drafter's softmax of log2 scores");
  m.def("attention", &exact_attention, "scaled dot-product attention with MLX's CPU bits");
  m.def("exp_buffer", &exp_buffer, "exp over n float32 values at src into dst");
}
