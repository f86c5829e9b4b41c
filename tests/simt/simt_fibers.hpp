// simt_fibers.hpp: the host emulator's execution state and fiber switching (part of simt_host.hpp, which says what
// is emulated): the block / warp / thread records, the x86-64 context switch, and the primitives every other part
// uses to stop a block (fail), exit a thread and park a thread until its barrier or warp collective completes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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

}  // namespace simt
