// simt_launch.hpp: running a grid on the host emulator (part of simt_host.hpp, which says what is emulated): the
// per-block scheduler (thread order or seeded shuffle, deadlock and shared-memory guard reports) and simt::launch,
// which unpacks a kernel's arguments and spreads its blocks over worker threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simt_fibers.hpp"

namespace simt {

// ---- running a grid -------------------------------------------------------------------------------------------------
inline std::string deadlock_report(const Block& b) {
  std::string msg = "deadlock: no thread can run;";
  int shown = 0;
  for (const Fiber& f : b.fibers) {
    if (f.state == kDone || shown >= 8) continue;
    char buf[96];
    std::snprintf(buf, sizeof buf, " thread %u waits at %s;", f.tid.x, f.where);
    msg += buf;
    ++shown;
  }
  return msg;
}

// Runs one block to completion on this OS thread; returns false (with b.error set) on a kernel error.
inline bool run_block(Block& b, char* stacks) {
  const int n = static_cast<int>(b.dim.x * b.dim.y * b.dim.z);
  b.fibers.assign(n, Fiber{});
  b.warps.assign((n + kWarpSize - 1) / kWarpSize, Warp{});
  for (int w = 0; w < static_cast<int>(b.warps.size()); ++w) b.warps[w].size = std::min(kWarpSize, n - w * kWarpSize);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.tid = uint3{static_cast<unsigned>(i % b.dim.x), static_cast<unsigned>((i / b.dim.x) % b.dim.y),
                  static_cast<unsigned>(i / (b.dim.x * b.dim.y))};
    f.lane = i % kWarpSize;
    f.warp = i / kWarpSize;
    f.sp = init_stack(stacks + static_cast<std::size_t>(i) * kStackBytes);
  }
  b.live = n;
  b.barrier_arrived = 0;
  b.failed = false;
  std::memset(b.smem, 0xff, b.smem_bytes + kSmemGuardBytes);
  std::memset(b.static_smem.data(), 0xff, b.static_smem.size());
  g_block = &b;
  // Each pass resumes every runnable thread once, in thread order when b.seed is 0, else in a fresh pseudo-random
  // order per pass (seeded by the block and the pass), so that results cannot depend on an order the hardware
  // does not promise (a missing barrier shows up as a wrong or NaN result).
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  const std::uint64_t block_id = b.idx.x + 65536ull * (b.idx.y + 65536ull * b.idx.z);
  std::uint64_t state = b.seed ? (b.seed * 0x9e3779b97f4a7c15ull) ^ block_id : 0;
  for (int i = 0; i < n; ++i) b.fibers[i].rng = (state ^ (0xbf58476d1ce4e5b9ull * (i + 1))) | 1;
  while (b.live > 0 && !b.failed) {
    bool ran = false;
    if (b.seed) {
      for (int i = n - 1; i > 0; --i) {  // Fisher-Yates with xorshift64*
        state ^= state >> 12; state ^= state << 25; state ^= state >> 27;
        std::swap(order[i], order[(state * 0x2545f4914f6cdd1dull >> 33) % static_cast<std::uint64_t>(i + 1)]);
      }
    }
    for (int i : order) {
      Fiber& f = b.fibers[i];
      if (f.state != kRunnable) continue;
      b.cur = &f;
      simt_ctx_switch(&b.sched_sp, f.sp);
      ran = true;
      if (b.failed) break;
    }
    if (!ran && !b.failed) {
      b.failed = true;
      char where[64];
      std::snprintf(where, sizeof where, " (block %u,%u,%u)", b.idx.x, b.idx.y, b.idx.z);
      b.error = deadlock_report(b) + where;
    }
  }
  if (!b.failed) {
    for (std::size_t i = 0; i < kSmemGuardBytes; ++i)
      if (static_cast<unsigned char>(b.smem[b.smem_bytes + i]) != 0xff) {
        b.failed = true;
        b.error = "write past the end of dynamic shared memory";
        break;
      }
  }
  g_block = nullptr;
  return !b.failed;
}

template <class Kernel, class Tuple> struct KernelCtx {
  Kernel kernel;
  Tuple args;
};

// Launch `kernel` over `grid` x `block` with `smem_bytes` of dynamic shared memory. `slots[i]` holds argument i in
// its low bytes (little endian, as numpy scalars' bytes). Blocks run on `workers` OS threads; `seed` picks the
// order threads run in between barriers (0: thread order). Returns 0, or 1 with the first error written to `err`.
template <class... Args, std::size_t... I>
int launch_impl(void (*kernel)(Args...), const std::uint64_t* slots, dim3 grid, dim3 block, std::size_t smem_bytes,
                int workers, std::uint64_t seed, char* err, std::size_t err_len, std::index_sequence<I...>) {
  using Tuple = std::tuple<std::decay_t<Args>...>;
  KernelCtx<void (*)(Args...), Tuple> ctx{kernel, Tuple{}};
  ((std::memcpy(&std::get<I>(ctx.args), &slots[I], sizeof(std::tuple_element_t<I, Tuple>))), ...);
  const long total = static_cast<long>(grid.x) * grid.y * grid.z;
  const long threads = static_cast<long>(block.x) * block.y * block.z;
  if (threads <= 0 || threads > 1024 || total <= 0) {
    std::snprintf(err, err_len, "invalid launch geometry: %ld blocks of %ld threads", total, threads);
    return 1;
  }
  std::atomic<long> next{0};
  std::atomic<bool> stop{false};
  std::mutex err_mutex;
  std::string first_error;
  auto work = [&]() {
    Block b;
    b.dim = block;
    b.grid = grid;
    b.smem_bytes = smem_bytes;
    b.seed = seed;
    std::vector<char> smem(smem_bytes + kSmemGuardBytes + 128);
    b.smem = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(smem.data()) + 127) & ~std::uintptr_t(127));
    b.static_smem.assign(48 * 1024, 0);
    b.invoke = [](const void* c) {
      auto* k = static_cast<const KernelCtx<void (*)(Args...), Tuple>*>(c);
      std::apply(k->kernel, k->args);
    };
    b.kernel_ctx = &ctx;
    // Not value-initialised: the OS maps a stack's pages only when a fiber touches them.
    std::unique_ptr<char[]> stacks(new char[static_cast<std::size_t>(threads) * kStackBytes]);
    for (long i; !stop && (i = next++) < total;) {
      b.idx = uint3{static_cast<unsigned>(i % grid.x), static_cast<unsigned>((i / grid.x) % grid.y),
                    static_cast<unsigned>(i / (static_cast<long>(grid.x) * grid.y))};
      if (!run_block(b, stacks.get())) {
        std::lock_guard<std::mutex> lock(err_mutex);
        if (first_error.empty()) first_error = b.error;
        stop = true;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::max(1, workers) && t < total; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (!first_error.empty()) {
    std::snprintf(err, err_len, "%s", first_error.c_str());
    return 1;
  }
  return 0;
}

template <class... Args>
int launch(void (*kernel)(Args...), const std::uint64_t* slots, int num_slots, const unsigned* geometry,
           std::size_t smem_bytes, int workers, std::uint64_t seed, char* err, std::size_t err_len) {
  if (num_slots != static_cast<int>(sizeof...(Args))) {
    std::snprintf(err, err_len, "the kernel takes %d arguments, got %d", static_cast<int>(sizeof...(Args)), num_slots);
    return 1;
  }
  static_assert(((sizeof(std::decay_t<Args>) <= 8) && ...), "kernel arguments of at most 8 bytes");
  return launch_impl(kernel, slots, dim3(geometry[0], geometry[1], geometry[2]),
                     dim3(geometry[3], geometry[4], geometry[5]), smem_bytes, workers, seed, err, err_len,
                     std::index_sequence_for<Args...>{});
}

}  // namespace simt
