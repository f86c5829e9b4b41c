// simt_host.hpp: runs the kernels of cuda/ on a CPU, one emulated CUDA thread per fiber, so that make test can
// check their results against the torch reference on a machine without a GPU.
//
// What is emulated (semantics from the CUDA C++ Programming Guide and the PTX ISA, sm_80):
//   - the execution model: a grid of thread blocks; each block's threads run as cooperative fibers on one OS thread
//     (blocks are spread over worker threads); threadIdx / blockIdx / blockDim / gridDim.
//   - __syncthreads (waits for every thread of the block that has not exited; threads waiting at two different
//     __syncthreads statements are reported, as the programming guide makes that undefined), warp collectives
//     (__shfl_sync, __shfl_xor_sync, ldmatrix, mma.sync): an operation runs when every lane of the warp has reached
//     it, on the values all lanes supplied, as the hardware's converged warp does. Lanes of one warp arriving at
//     different collectives, a collective in a warp with an exited lane, or a barrier that can never complete are
//     reported as errors, not hung on.
//   - cp.async: copies are queued per thread and performed when cp.async.wait_group retires their group, the
//     latest moment the PTX ISA allows, so a kernel that reads a staged tile before waiting for it reads garbage;
//     in the shuffled mode (below) each copy instead lands at once with probability 1/2, so a kernel that reissues
//     copies into a buffer other threads may still be reading gets corrupted data.
//   - global reads through __ldg and cp.async are checked to fall inside the storage of a tensor argument (when
//     the launcher registered them: Simulator does).
//   - shared memory, dynamic and static, is filled with 0xff bytes (NaN as fp32/fp16/bf16) at each block's start;
//     ldmatrix and cp.async addresses are checked to lie inside the dynamic part and be 16-byte aligned, and a
//     guard region after it is checked at the block's end.
//   - thread order: between barriers a block's threads run in thread order (seed 0) or, by default from Python, in
//     a seeded pseudo-random order per pass, so results cannot lean on an order the hardware does not promise.
// Not emulated: timing, memory-model races between threads inside one barrier interval beyond what the shuffled
// order exposes (a block's fibers interleave only at barriers and collectives), plain (non-__ldg) global loads and
// stores are not bounds-checked, bank conflicts, register limits (ptxas reports those:
// tests/kernels/test_kernels_compile.py).
//
// The including translation unit defines PAGEDSERVE_SIMT_HOST, includes this file, then the kernel source with
// `extern __shared__ T name[];` rewritten to `T* name = reinterpret_cast<T*>(::simt::dynamic_smem());` and
// `__shared__ T name[N];` to `T* name = ::simt::static_smem<T>(N, <site id>);`
// (tests/simt/__init__.py does both), and defines one extern "C" entry point per kernel instantiation that calls
// simt::launch(&kernel<...>, ...).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_functions.h>

#define __launch_bounds__(...)

namespace simt {

constexpr std::size_t kStackBytes = 256 * 1024;  // per emulated thread
constexpr std::size_t kSmemGuardBytes = 256;
constexpr int kWarpSize = 32;

enum State : unsigned char { kRunnable, kWaitWarp, kWaitBlock, kDone };

struct PendingCopy {
  void* dst;
  const void* src;
  bool pred;
};

struct Fiber {
  void* sp = nullptr;
  uint3 tid{0, 0, 0};
  int lane = 0, warp = 0;
  State state = kRunnable;
  std::vector<PendingCopy> copies;      // issued cp.async copies not yet performed, oldest first
  std::vector<std::size_t> group_ends;  // committed groups: one past each group's last entry in `copies`
  std::uint64_t rng = 0;                // per-thread xorshift state (shuffled mode)
  const char* where = "";               // what the fiber waits on (for deadlock reports)
};

enum class Op : int { kNone, kShfl, kLdmatrix, kLdmatrixTrans, kMmaF16, kMmaBf16 };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::kShfl: return "shfl";
    case Op::kLdmatrix: return "ldmatrix";
    case Op::kLdmatrixTrans: return "ldmatrix.trans";
    case Op::kMmaF16: return "mma.f16";
    case Op::kMmaBf16: return "mma.bf16";
    default: return "none";
  }
}

struct Warp {
  int size = kWarpSize;  // lanes that exist (the block's last warp may be partial)
  int arrived = 0;
  int exited = 0;
  Op op = Op::kNone;
  std::uint32_t in[kWarpSize][10];
  int src_lane[kWarpSize];
  const void* addr[kWarpSize];
  std::uint32_t out[kWarpSize][4];
};

struct Block {
  uint3 idx{0, 0, 0};
  dim3 dim, grid;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Fiber* cur = nullptr;
  void* sched_sp = nullptr;
  char* smem = nullptr;
  std::size_t smem_bytes = 0;
  std::vector<char> static_smem;                     // the block's static __shared__ arrays
  std::vector<std::pair<int, std::size_t>> static_sites;  // (declaration site, offset into static_smem)
  std::size_t static_used = 0;
  const char* barrier_site = nullptr;                // the __syncthreads the waiting threads are at
  std::uint64_t seed = 0;                            // 0: thread order, copies land at the wait; else shuffled
  int live = 0;
  int barrier_arrived = 0;
  bool failed = false;
  std::string error;
  void (*invoke)(const void*) = nullptr;
  const void* kernel_ctx = nullptr;
};

inline thread_local Block* g_block = nullptr;

}  // namespace simt

// ---- context switch (x86-64 System V) ------------------------------------------------------------------------------
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores the stack pointer
// in *save_sp, and resumes the context whose stack pointer is load_sp.
extern "C" void simt_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl simt_ctx_switch
  .hidden simt_ctx_switch
  .type simt_ctx_switch, @function
simt_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_ctx_switch, .-simt_ctx_switch
)");

namespace simt {

inline void to_scheduler() {
  Block& b = *g_block;
  simt_ctx_switch(&b.cur->sp, b.sched_sp);
}

// Stop the block: the error is reported by launch(); the failing fiber never runs again.
[[noreturn]] inline void fail(const std::string& msg) {
  Block& b = *g_block;
  if (!b.failed) {
    b.failed = true;
    char where[96];
    std::snprintf(where, sizeof where, " (block %u,%u,%u thread %u,%u,%u)", b.idx.x, b.idx.y, b.idx.z,
                  b.cur->tid.x, b.cur->tid.y, b.cur->tid.z);
    b.error = msg + where;
  }
  to_scheduler();
  std::abort();  // unreachable: a failed block's fibers are never resumed
}

inline void perform(const PendingCopy& c) {
  if (c.pred) std::memcpy(c.dst, c.src, 16);
  else std::memset(c.dst, 0, 16);
}

inline void on_exit() {
  Block& b = *g_block;
  Fiber& f = *b.cur;
  for (const PendingCopy& c : f.copies) perform(c);  // outstanding copies still land
  f.copies.clear();
  f.state = kDone;
  --b.live;
  ++b.warps[f.warp].exited;
  if (b.barrier_arrived > 0 && b.barrier_arrived == b.live) {  // the others now form the whole block
    b.barrier_arrived = 0;
    for (Fiber& o : b.fibers)
      if (o.state == kWaitBlock) o.state = kRunnable;
  }
}

[[noreturn]] inline void fiber_entry() {
  Block& b = *g_block;
  b.invoke(b.kernel_ctx);
  on_exit();
  to_scheduler();
  std::abort();
}

inline void* init_stack(char* stack_base) {
  auto top = reinterpret_cast<std::uintptr_t>(stack_base + kStackBytes) & ~std::uintptr_t(15);
  auto* sp = reinterpret_cast<std::uint64_t*>(top);
  *--sp = 0;                                                   // fake return address of fiber_entry
  *--sp = reinterpret_cast<std::uint64_t>(&fiber_entry);       // where `ret` goes
  for (int i = 0; i < 6; ++i) *--sp = 0;                       // rbp, rbx, r12-r15
  *--sp = 0x1f80;                                              // MXCSR default (at sp + 8)
  *--sp = 0x037f;                                              // x87 control word default (at sp)
  return sp;
}

inline void park(State s, const char* where) {
  Fiber& f = *g_block->cur;
  f.state = s;
  f.where = where;
  to_scheduler();
}

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

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give the row addresses of matrix i. Without
// .trans lane l receives row l/4, elements 2(l%4) and 2(l%4)+1 of each matrix; with .trans, column l/4, rows 2(l%4)
// and 2(l%4)+1. The lower-indexed element is in the low 16 bits.
inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* p, bool trans) {
  check_smem(p, 16, "ldmatrix");
  Block& b = *g_block;
  const int lane = b.cur->lane;
  Warp& w = b.warps[b.cur->warp];
  if (w.size != kWarpSize) fail("ldmatrix: needs a full warp");
  w.addr[lane] = p;
  auto elem = [](const Warp& w, int matrix, int row, int col) -> std::uint32_t {
    return static_cast<const std::uint16_t*>(w.addr[8 * matrix + row])[col];
  };
  if (!trans) {
    warp_collective(Op::kLdmatrix, [&](Warp& w) {
      for (int l = 0; l < kWarpSize; ++l)
        for (int i = 0; i < 4; ++i)
          w.out[l][i] = elem(w, i, l >> 2, 2 * (l & 3)) | (elem(w, i, l >> 2, 2 * (l & 3) + 1) << 16);
    });
  } else {
    warp_collective(Op::kLdmatrixTrans, [&](Warp& w) {
      for (int l = 0; l < kWarpSize; ++l)
        for (int i = 0; i < 4; ++i)
          w.out[l][i] = elem(w, i, 2 * (l & 3), l >> 2) | (elem(w, i, 2 * (l & 3) + 1, l >> 2) << 16);
    });
  }
  for (int i = 0; i < 4; ++i) r[i] = w.out[lane][i];
}

inline float half_bits_to_float(std::uint32_t bits) {
  __half_raw raw;
  raw.x = static_cast<unsigned short>(bits);
  return __half2float(__half(raw));
}
inline float bf16_bits_to_float(std::uint32_t bits) {
  const std::uint32_t u = bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, D = A B + C, with the PTX ISA fragment layouts
// (g = lane / 4, t = lane % 4): A registers a[0..3] hold A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..];
// B registers b0, b1 hold B[2t..2t+1][g], B[2t+8..2t+9][g]; C/D hold C[g][2t..2t+1], C[g+8][2t..2t+1].
// Products are exact in fp32 and summed in fp32, k in order.
inline void mma_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1, bool bf16) {
  Block& b = *g_block;
  const int lane = b.cur->lane;
  Warp& w = b.warps[b.cur->warp];
  if (w.size != kWarpSize) fail("mma: needs a full warp");
  for (int i = 0; i < 4; ++i) w.in[lane][i] = a[i];
  w.in[lane][4] = b0;
  w.in[lane][5] = b1;
  std::memcpy(&w.in[lane][6], d, 16);
  auto compute = [bf16](Warp& w) {
    float A[16][16], B[16][8], C[16][8];
    auto to_f = [bf16](std::uint32_t bits) { return bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits); };
    auto lo = [&](std::uint32_t v) { return to_f(v & 0xffff); };
    auto hi = [&](std::uint32_t v) { return to_f(v >> 16); };
    for (int l = 0; l < kWarpSize; ++l) {
      const int g = l >> 2, t = l & 3;
      const std::uint32_t* in = w.in[l];
      A[g][2 * t] = lo(in[0]);         A[g][2 * t + 1] = hi(in[0]);
      A[g + 8][2 * t] = lo(in[1]);     A[g + 8][2 * t + 1] = hi(in[1]);
      A[g][2 * t + 8] = lo(in[2]);     A[g][2 * t + 9] = hi(in[2]);
      A[g + 8][2 * t + 8] = lo(in[3]); A[g + 8][2 * t + 9] = hi(in[3]);
      B[2 * t][g] = lo(in[4]);         B[2 * t + 1][g] = hi(in[4]);
      B[2 * t + 8][g] = lo(in[5]);     B[2 * t + 9][g] = hi(in[5]);
      float c[4];
      std::memcpy(c, &in[6], 16);
      C[g][2 * t] = c[0]; C[g][2 * t + 1] = c[1]; C[g + 8][2 * t] = c[2]; C[g + 8][2 * t + 1] = c[3];
    }
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 8; ++n) {
        float acc = C[m][n];
        for (int k = 0; k < 16; ++k) acc += A[m][k] * B[k][n];
        C[m][n] = acc;
      }
    for (int l = 0; l < kWarpSize; ++l) {
      const int g = l >> 2, t = l & 3;
      const float c[4] = {C[g][2 * t], C[g][2 * t + 1], C[g + 8][2 * t], C[g + 8][2 * t + 1]};
      std::memcpy(w.out[l], c, 16);
    }
  };
  warp_collective(bf16 ? Op::kMmaBf16 : Op::kMmaF16, compute);
  std::memcpy(d, w.out[lane], 16);
}

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

// ---- CUDA built-ins -------------------------------------------------------------------------------------------------
#define threadIdx (::simt::g_block->cur->tid)
#define blockIdx (::simt::g_block->idx)
#define blockDim (::simt::g_block->dim)
#define gridDim (::simt::g_block->grid)

#define SIMT_STR2(x) #x
#define SIMT_STR(x) SIMT_STR2(x)
#define __syncthreads() ::simt::syncthreads(__FILE__ ":" SIMT_STR(__LINE__))
[[noreturn]] inline void __trap() { ::simt::fail("__trap()"); }
// PTX shfl.sync.bfly: source lane ^ lane_mask; a source past the end of the caller's width-lane segment gives the
// caller's own value.
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  ::simt::check_full_mask(mask);
  const int lane = ::simt::g_block->cur->lane;
  const int src = lane ^ (lane_mask & 31), segment_end = (lane & ~(width - 1)) + width - 1;
  return ::simt::shfl(v, src <= segment_end ? src : lane);
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  ::simt::check_full_mask(mask);
  const int lane = ::simt::g_block->cur->lane;
  return ::simt::shfl(v, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <class T> inline T __ldg(const T* p) {
  ::simt::check_global(p, sizeof(T), "__ldg");
  return *p;
}

extern "C" __attribute__((visibility("default"))) void simt_set_ranges(const std::uint64_t* ranges, int count) {
  ::simt::g_ranges.clear();
  for (int i = 0; i < count; ++i) ::simt::g_ranges.emplace_back(ranges[2 * i], ranges[2 * i + 1]);
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// The PTX wrappers of cuda/common.cuh (skipped there under PAGEDSERVE_SIMT_HOST).
namespace pagedserve {
inline unsigned int dynamic_smem_bytes() { return static_cast<unsigned int>(::simt::g_block->smem_bytes); }
inline void cp_async_16(void* smem, const void* gmem, bool pred) { ::simt::cp_async_16(smem, gmem, pred); }
inline void cp_async_commit() { ::simt::cp_async_commit(); }
template <int N> inline void cp_async_wait() { ::simt::cp_async_wait(N); }
inline void ldmatrix_x4(unsigned int (&r)[4], const void* smem) { ::simt::ldmatrix_x4(r, smem, false); }
inline void ldmatrix_x4_trans(unsigned int (&r)[4], const void* smem) { ::simt::ldmatrix_x4(r, smem, true); }
template <typename T> inline void mma_16816(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                            unsigned int b1) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, "f16 or bf16");
  ::simt::mma_16816(d, a, b0, b1, std::is_same<T, __nv_bfloat16>::value);
}
}  // namespace pagedserve
