// Driver helpers for emulated Metal kernels: array file I/O and the grid launcher.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
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

namespace emu {
using Body = std::function<void(uint3, uint3, uint3, uint3, uint3, uint3, uint)>;

// dispatchThreads semantics: threadgroups of size tg tile the grid; edge groups are partial.
// Groups run one after another. Without barriers, a group's threads run serially in index
// order; with barriers, each thread is an OS thread and threadgroup_barrier() waits for all
// threads of the group.
inline void launch(uint3 grid, uint3 tg, bool threaded, const Body& body) {
  uint3 ngroups = {(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y,
                   (grid.z + tg.z - 1) / tg.z};
  for (uint gz = 0; gz < ngroups.z; ++gz)
    for (uint gy = 0; gy < ngroups.y; ++gy)
      for (uint gx = 0; gx < ngroups.x; ++gx) {
        uint3 gpos = {gx, gy, gz};
        uint3 size = {std::min(tg.x, grid.x - gx * tg.x), std::min(tg.y, grid.y - gy * tg.y),
                      std::min(tg.z, grid.z - gz * tg.z)};
        std::vector<std::function<void()>> threads;
        for (uint lz = 0; lz < size.z; ++lz)
          for (uint ly = 0; ly < size.y; ++ly)
            for (uint lx = 0; lx < size.x; ++lx) {
              uint3 local = {lx, ly, lz};
              uint3 global = {gx * tg.x + lx, gy * tg.y + ly, gz * tg.z + lz};
              uint index = (lz * size.y + ly) * size.x + lx;
              threads.push_back([=, &body] {
                body(global, local, gpos, size, ngroups, grid, index);
              });
            }
        if (!threaded) {
          emu::current_barrier = nullptr;
          for (auto& t : threads) t();
          continue;
        }
        Barrier barrier;
        barrier.count = static_cast<int>(threads.size());
        emu::current_barrier = &barrier;
        std::vector<os_thread> pool;
        pool.reserve(threads.size());
        for (auto& t : threads) pool.emplace_back(t);
        for (auto& t : pool) t.join();
        emu::current_barrier = nullptr;
      }
}
}  // namespace emu
