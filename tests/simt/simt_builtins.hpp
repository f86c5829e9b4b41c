// simt_builtins.hpp: the CUDA built-ins the kernels of cuda/ use (threadIdx and friends, __syncthreads, shuffles,
// __ldg, bit casts, min/max) and the PTX wrappers of cuda/common.cuh, mapped onto the host emulator (part of
// simt_host.hpp, which says what is emulated). Included last: its macros rename threadIdx, blockIdx, ... .
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simt_mma.hpp"
#include "simt_sync.hpp"

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
