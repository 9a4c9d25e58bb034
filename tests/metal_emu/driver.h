// Driver helpers for emulated Metal kernels: array file I/O and the grid launcher.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

template <typename T>
T poison() {
  if constexpr (std::is_integral<T>::value) {
    return static_cast<T>(0xDEADBEEFu);
  } else {
    return T(std::numeric_limits<float>::quiet_NaN());
  }
}

// Read input `idx` (stored as F: float32 or a 32-bit integer) into a vector of Metal type T.
template <typename T, typename F>
std::vector<T> load(const std::string& dir, int idx, size_t n) {
  std::vector<F> raw(n);
  std::string path = dir + "/in" + std::to_string(idx) + ".bin";
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(raw.data(), sizeof(F), n, f) != n) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  std::fclose(f);
  std::vector<T> out;
  out.reserve(n);
  for (const F& v : raw) out.push_back(T(v));
  return out;
}

// Write output `idx` as float32 (float types) or as its 32-bit integer type.
template <typename T>
void save(const std::string& dir, int idx, const std::vector<T>& v) {
  std::string path = dir + "/out" + std::to_string(idx) + ".bin";
  FILE* f = std::fopen(path.c_str(), "wb");
  for (const T& x : v) {
    if constexpr (std::is_integral<T>::value) {
      std::fwrite(&x, sizeof(T), 1, f);
    } else {
      float y = static_cast<float>(x);
      std::fwrite(&y, sizeof(float), 1, f);
    }
  }
  std::fclose(f);
}

// Write a vector of 32-bit integers as they are (read counts).
inline void save_raw(const std::string& path, const std::vector<uint32_t>& v) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(v.data(), sizeof(uint32_t), v.size(), f);
  std::fclose(f);
}

namespace emu {
// An input whose element reads are counted (EmulatedKernel's count_reads): the body may
// only index it (x[i]), as it would a device pointer.
template <typename T>
struct Counted {
  const T* data;
  uint32_t* counts;
  const T& operator[](size_t i) const {
    ++counts[i];
    return data[i];
  }
};

// The launch's run-time numbers (sizes, shapes, strides, grid, threadgroup), read in order
// from meta.txt: nothing shape-dependent is compiled in, as with MLX's Metal libraries.
struct Meta {
  FILE* f;
  explicit Meta(const std::string& dir) : f(std::fopen((dir + "/meta.txt").c_str(), "r")) {
    if (!f) {
      std::fprintf(stderr, "cannot read %s/meta.txt\n", dir.c_str());
      std::exit(2);
    }
  }
  ~Meta() { std::fclose(f); }
  long long next() {
    long long v = 0;
    if (std::fscanf(f, "%lld", &v) != 1) {
      std::fprintf(stderr, "meta.txt ended early\n");
      std::exit(2);
    }
    return v;
  }
  template <typename T>
  std::vector<T> take(int n) {
    std::vector<T> v;
    for (int i = 0; i < n; ++i) v.push_back(static_cast<T>(next()));
    return v;
  }
  uint3 dims() {
    uint3 d;
    d.x = uint(next());
    d.y = uint(next());
    d.z = uint(next());
    return d;
  }
};

using Body = std::function<void(uint3, uint3, uint3, uint3, uint3, uint3, uint)>;

// One Metal thread of the current threadgroup, run as a fiber.
struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;  // not zero-filled: allocation stays cheap
  std::function<void()> fn;
  bool done = false;
  long barriers = 0;  // barriers passed so far
};
inline ucontext_t scheduler_ctx;
inline Fiber* running = nullptr;

inline void fiber_main() {
  running->fn();
  running->done = true;  // uc_link returns to the scheduler
}
inline void fiber_yield_at_barrier() {
  ++running->barriers;
  swapcontext(&running->ctx, &scheduler_ctx);
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "metal_emu: %s\n", what);
  std::exit(3);
}

// Run one threadgroup: phase by phase, every live fiber runs until its next barrier (or its
// end) in the given order. All threads must reach each barrier (Metal requires it).
inline void run_group(std::vector<std::function<void()>>& threads, bool reverse) {
  const size_t n = threads.size();
  std::vector<Fiber> fibers(n);
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f.fn = threads[i];
    constexpr size_t kStack = 64 * 1024;
    f.stack.reset(new char[kStack]);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &scheduler_ctx;
    makecontext(&f.ctx, fiber_main, 0);
  }
  barrier_hook = fiber_yield_at_barrier;
  simd_slots.assign(n, 0.0f);
  for (;;) {
    for (size_t j = 0; j < n; ++j) {
      const size_t i = reverse ? n - 1 - j : j;
      Fiber& f = fibers[i];
      if (f.done) continue;
      running = &f;
      current_thread = uint(i);  // threads are listed by their index in the threadgroup
      swapcontext(&scheduler_ctx, &f.ctx);
    }
    size_t done = 0;
    for (auto& f : fibers) done += f.done ? 1 : 0;
    if (done == n) break;
    if (done != 0) fail("some threads of a threadgroup finished while others wait at a barrier");
    for (auto& f : fibers)
      if (f.barriers != fibers[0].barriers) fail("threads wait at different barrier counts");
  }
  running = nullptr;
  barrier_hook = nullptr;
}

// dispatchThreads semantics: threadgroups of size tg tile the grid; edge groups are partial.
// Groups run one after another (in reverse order too when `reverse`).
inline void launch(uint3 grid, uint3 tg, bool reverse, const Body& body) {
  uint3 ngroups = {(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y,
                   (grid.z + tg.z - 1) / tg.z};
  const uint total = ngroups.x * ngroups.y * ngroups.z;
  for (uint gi = 0; gi < total; ++gi) {
    const uint g = reverse ? total - 1 - gi : gi;
    const uint3 gpos = {g % ngroups.x, (g / ngroups.x) % ngroups.y, g / (ngroups.x * ngroups.y)};
    const uint3 size = {std::min(tg.x, grid.x - gpos.x * tg.x),
                        std::min(tg.y, grid.y - gpos.y * tg.y),
                        std::min(tg.z, grid.z - gpos.z * tg.z)};
    std::vector<std::function<void()>> threads;
    for (uint lz = 0; lz < size.z; ++lz)
      for (uint ly = 0; ly < size.y; ++ly)
        for (uint lx = 0; lx < size.x; ++lx) {
          const uint3 local = {lx, ly, lz};
          const uint3 global = {gpos.x * tg.x + lx, gpos.y * tg.y + ly, gpos.z * tg.z + lz};
          const uint index = (lz * size.y + ly) * size.x + lx;
          threads.push_back([=, &body] { body(global, local, gpos, size, ngroups, grid, index); });
        }
    run_group(threads, reverse);
  }
}
}  // namespace emu
