// Minimal C++ model of the Metal Shading Language subset used by dflash_mlx/metal/*.metal.
//
// Purpose: compile a kernel body (as passed to mx.fast.metal_kernel) with g++ on Linux and
// run it over the whole grid, so its logic can be checked against the MLX reference without
// a Mac. What is modelled:
//   * address-space qualifiers (device, constant, thread) are dropped; `threadgroup` becomes
//     `static`, i.e. storage shared by every thread of the function. The driver runs one
//     threadgroup at a time, so this is exactly threadgroup-shared memory.
//   * threads of a threadgroup are cooperative fibers (ucontext); threadgroup_barrier()
//     suspends the calling fiber until every thread of its group has reached it. Between
//     barriers the fibers run one after another in a chosen order (forward or reverse), so a
//     missing barrier or a cross-thread race shows up as a result that depends on the order.
//   * bfloat16_t / bfloat: float storage, round-to-nearest-even to bf16 on every store.
//   * float16_t / half: the compiler's _Float16 (IEEE binary16, RNE conversions).
//   * metal:: math on float (exp, max, min, fma, abs, ...).
//   * simd_sum(float) in uniform control flow (see below), and the SIMD lane / SIMD-group
//     attributes: 32 lanes, lane = thread index in threadgroup % 32.
// Not modelled (the harness refuses kernels that use them): other SIMD-group and quad-group
// functions, atomics, textures.
#pragma once

// Every standard header the shim and driver need comes before the qualifier macros below.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

typedef uint32_t uint;
typedef unsigned long ulong;
typedef unsigned short ushort;
typedef unsigned char uchar;

#define device
#define constant
#define thread
#define threadgroup static
#define METAL_FUNC inline

struct uint3 {
  uint32_t x, y, z;
};

// bfloat16: the value is kept as a float that is always exactly representable in bf16.
struct bfloat16_t {
  float v;
  static float round_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) {  // inf / nan: truncate, keep nan quiet
      if (u & 0x007fffffu) u |= 0x00400000u;
      u &= 0xffff0000u;
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
      u &= 0xffff0000u;
    }
    float r;
    std::memcpy(&r, &u, 4);
    return r;
  }
  bfloat16_t() : v(0.0f) {}
  bfloat16_t(float f) : v(round_bf16(f)) {}
  bfloat16_t(double f) : v(round_bf16(static_cast<float>(f))) {}
  bfloat16_t(int i) : v(round_bf16(static_cast<float>(i))) {}
  operator float() const { return v; }
};
typedef bfloat16_t bfloat;
typedef _Float16 float16_t;
typedef _Float16 half;

// threadgroup_barrier() hands control back to the driver's scheduler (see driver.h).
namespace emu {
inline void (*barrier_hook)() = nullptr;
inline uint current_thread = 0;          // index in threadgroup of the running fiber
inline std::vector<float> simd_slots;    // one per thread of the current threadgroup
inline bool lane_sum_reversed = false;   // tests only: a deliberately reordered reduction
}  // namespace emu

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline void threadgroup_barrier(mem_flags) {
  if (emu::barrier_hook) emu::barrier_hook();
}

inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float tanh(float x) { return std::tanh(x); }
inline float abs(float x) { return std::fabs(x); }
inline float fabs(float x) { return std::fabs(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return std::max(a, b); }
inline int min(int a, int b) { return std::min(a, b); }
inline uint max(uint a, uint b) { return std::max(a, b); }
inline uint min(uint a, uint b) { return std::min(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
template <typename T>
struct numeric_limits : std::numeric_limits<T> {};
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float divide(float a, float b) { return a / b; }
}  // namespace precise
namespace fast {
inline float exp(float x) { return std::exp(x); }
}  // namespace fast
}  // namespace metal

using metal::threadgroup_barrier;

// simd_sum: the 32 lanes' sum, which every lane receives. Our ASSUMPTION of the hardware's
// order (Apple does not document it): a butterfly, for off = 16, 8, 4, 2, 1 lane l takes
// v[l] + v[l ^ off] (commutative, so every lane ends with the same bits). Each thread
// publishes its value in a slot, a barrier, each thread replays the butterfly over its
// SIMD-group's 32 slots, a second barrier before the slots are reused. The barriers make it
// stricter than Metal: every thread of the threadgroup must call it (uniform control flow).
// emu::lane_sum_reversed (tests) runs off = 1, 2, 4, 8, 16 instead.
namespace metal {
inline float simd_sum(float v) {
  const uint me = emu::current_thread;
  emu::simd_slots[me] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint first = me - me % 32;
  const uint lanes = std::min<uint>(32, uint(emu::simd_slots.size()) - first);
  float a[32] = {0.0f};
  for (uint l = 0; l < lanes; ++l) a[l] = emu::simd_slots[first + l];
  for (int r = 0; r < 5; ++r) {
    const uint off = emu::lane_sum_reversed ? (1u << r) : (16u >> r);
    float b[32];
    for (uint l = 0; l < 32; ++l) b[l] = a[l] + a[l ^ off];
    std::memcpy(a, b, sizeof(a));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return a[me % 32];
}
}  // namespace metal
using metal::simd_sum;
