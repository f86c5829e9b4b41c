// simt_sync.hpp: __syncthreads, warp collectives and shuffles, shared memory (dynamic and static), the global-read
// range check and cp.async for the host emulator (part of simt_host.hpp, which says what is emulated).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "simt_fibers.hpp"

namespace simt {

// ---- barriers and warp collectives ----------------------------------------------------------------------------------
inline void syncthreads(const char* site) {
  Block& b = *g_block;
  if (b.barrier_arrived == 0) {
    b.barrier_site = site;
  } else if (std::strcmp(b.barrier_site, site) != 0) {
    fail(std::string("threads wait at different __syncthreads: ") + b.barrier_site + " and " + site);
  }
  if (++b.barrier_arrived == b.live) {
    b.barrier_arrived = 0;
    for (Fiber& o : b.fibers)
      if (o.state == kWaitBlock) o.state = kRunnable;
    return;
  }
  park(kWaitBlock, site);
}

// Every lane of the calling warp deposits its inputs, then calls this. The last to arrive runs `compute` for the
// whole warp and releases the others; each lane then reads its own outputs.
template <class F> inline void warp_collective(Op op, F&& compute) {
  Block& b = *g_block;
  Fiber& f = *b.cur;
  Warp& w = b.warps[f.warp];
  if (w.exited) fail(std::string(op_name(op)) + ": warp collective in a warp where a lane has exited");
  if (w.arrived == 0) {
    w.op = op;
  } else if (w.op != op) {
    fail(std::string("divergent warp: lanes at ") + op_name(w.op) + " and at " + op_name(op));
  }
  if (++w.arrived == w.size) {
    compute(w);
    w.arrived = 0;
    w.op = Op::kNone;
    for (int l = 0; l < w.size; ++l) {
      Fiber& o = b.fibers[f.warp * kWarpSize + l];
      if (o.state == kWaitWarp) o.state = kRunnable;
    }
    return;
  }
  park(kWaitWarp, op_name(op));
}

inline void check_full_mask(unsigned mask) {
  const Warp& w = g_block->warps[g_block->cur->warp];
  const unsigned full = w.size == 32 ? 0xffffffffu : ((1u << w.size) - 1u);
  if (mask != full) fail("shfl: only full-warp masks are emulated");
}

template <class T> inline T shfl(T v, int src) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  Block& b = *g_block;
  const int lane = b.cur->lane;
  Warp& w = b.warps[b.cur->warp];
  std::memcpy(&w.in[lane][0], &v, 4);
  w.src_lane[lane] = src;
  warp_collective(Op::kShfl, [](Warp& w) {
    for (int l = 0; l < w.size; ++l) {
      const int s = w.src_lane[l];
      w.out[l][0] = w.in[(s >= 0 && s < w.size) ? s : l][0];
    }
  });
  T r;
  std::memcpy(&r, &w.out[lane][0], 4);
  return r;
}

// ---- shared memory --------------------------------------------------------------------------------------------------
inline void* dynamic_smem() { return g_block->smem; }

// The static __shared__ array declared at `site` (count elements of T), placed in the block's static arena on first
// use; every thread of the block gets the same address.
template <class T> inline T* static_smem(std::size_t count, int site) {
  Block& b = *g_block;
  for (const auto& [s, offset] : b.static_sites)
    if (s == site) return reinterpret_cast<T*>(b.static_smem.data() + offset);
  const std::size_t offset = (b.static_used + 15) & ~std::size_t(15);
  if (offset + count * sizeof(T) > b.static_smem.size()) fail("static shared memory over 48 KiB");
  b.static_used = offset + count * sizeof(T);
  b.static_sites.emplace_back(site, offset);
  return reinterpret_cast<T*>(b.static_smem.data() + offset);
}

inline void check_smem(const void* p, std::size_t bytes, const char* what) {
  const Block& b = *g_block;
  const char* c = static_cast<const char*>(p);
  if (c < b.smem || c + bytes > b.smem + b.smem_bytes)
    fail(std::string(what) + ": shared-memory address outside the block's dynamic shared memory");
  if (reinterpret_cast<std::uintptr_t>(p) % 16) fail(std::string(what) + ": shared-memory address not 16-byte aligned");
}

// Global memory a launch may read through __ldg and cp.async: the storages of its tensor arguments, [lo, hi) byte
// ranges set by simt_set_ranges before the launch (empty: not checked).
inline std::vector<std::pair<std::uintptr_t, std::uintptr_t>> g_ranges;

inline void check_global(const void* p, std::size_t bytes, const char* what) {
  if (g_ranges.empty()) return;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  for (const auto& [lo, hi] : g_ranges)
    if (a >= lo && a + bytes <= hi) return;
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s: read of %zu bytes at %p, outside every tensor argument", what, bytes, p);
  fail(buf);
}

inline void cp_async_16(void* smem, const void* gmem, bool pred) {
  check_smem(smem, 16, "cp.async");
  if (pred) check_global(gmem, 16, "cp.async");
  if (pred && reinterpret_cast<std::uintptr_t>(gmem) % 16) fail("cp.async: global address not 16-byte aligned");
  Fiber& f = *g_block->cur;
  if (g_block->seed) {
    f.rng ^= f.rng >> 12; f.rng ^= f.rng << 25; f.rng ^= f.rng >> 27;
    if ((f.rng * 0x2545f4914f6cdd1dull) >> 63) {  // lands at once (the earliest the ISA allows)
      perform({smem, gmem, pred});
      return;
    }
  }
  f.copies.push_back({smem, gmem, pred});
}

inline void cp_async_commit() {
  Fiber& f = *g_block->cur;
  f.group_ends.push_back(f.copies.size());
}

inline void cp_async_wait(int n) {
  Fiber& f = *g_block->cur;
  const int groups = static_cast<int>(f.group_ends.size());
  if (groups <= n) return;
  const std::size_t end = f.group_ends[groups - n - 1];
  for (std::size_t i = 0; i < end; ++i) perform(f.copies[i]);
  f.copies.erase(f.copies.begin(), f.copies.begin() + static_cast<std::ptrdiff_t>(end));
  f.group_ends.erase(f.group_ends.begin(), f.group_ends.begin() + (groups - n));
  for (std::size_t& e : f.group_ends) e -= end;
}

}  // namespace simt
