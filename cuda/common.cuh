// Shared device helpers for the pagedserve kernels: dtype conversion, 16-byte vector packing, warp and block
// reductions, and thin wrappers over the PTX instructions the attention kernels use (cp.async, ldmatrix, mma).
//
// Compiled with NVRTC (no host standard library). Included textually by service/pagedserve/kernels.py, which
// inlines `#include "..."` lines of this folder, so every .cu file is one self-contained translation unit.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace pagedserve {

typedef long long i64;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- scalar conversion ------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Round a float through T (what torch does when an op's result is stored in T).
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// ---- 16-byte vectors --------------------------------------------------------------------------------------------
// A uint4 holds kVec<T> elements of T; unpack/pack convert them to and from fp32.
template <typename T> struct VecTraits { static constexpr int kVec = 16 / (int)sizeof(T); };

__device__ __forceinline__ void unpack(const uint4& v, float (&f)[4]) {
  f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
}

__device__ __forceinline__ float2 half2_bits_to_float2(unsigned int bits) {
  __half2 h = *reinterpret_cast<__half2*>(&bits);
  return __half22float2(h);
}

__device__ __forceinline__ float2 bf162_bits_to_float2(unsigned int bits) {
  // bf16 -> fp32 is a 16-bit shift: exact and cheap.
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}

template <typename T> __device__ __forceinline__ void unpack_vec(const uint4& v, float (&f)[VecTraits<T>::kVec]);

template <> __device__ __forceinline__ void unpack_vec<float>(const uint4& v, float (&f)[4]) { unpack(v, f); }

template <> __device__ __forceinline__ void unpack_vec<__half>(const uint4& v, float (&f)[8]) {
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 p = half2_bits_to_float2(w[i]);
    f[2 * i] = p.x; f[2 * i + 1] = p.y;
  }
}

template <> __device__ __forceinline__ void unpack_vec<__nv_bfloat16>(const uint4& v, float (&f)[8]) {
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 p = bf162_bits_to_float2(w[i]);
    f[2 * i] = p.x; f[2 * i + 1] = p.y;
  }
}

// Two fp32 values to one 32-bit register of two T (low half = a), round to nearest even.
template <typename T> __device__ __forceinline__ unsigned int pack2(float a, float b);
template <> __device__ __forceinline__ unsigned int pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned int*>(&h);
}
template <> __device__ __forceinline__ unsigned int pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned int*>(&h);
}

template <typename T> __device__ __forceinline__ uint4 pack_vec(const float (&f)[VecTraits<T>::kVec]);
template <> __device__ __forceinline__ uint4 pack_vec<float>(const float (&f)[4]) {
  return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
}
template <> __device__ __forceinline__ uint4 pack_vec<__half>(const float (&f)[8]) {
  return make_uint4(pack2<__half>(f[0], f[1]), pack2<__half>(f[2], f[3]), pack2<__half>(f[4], f[5]),
                    pack2<__half>(f[6], f[7]));
}
template <> __device__ __forceinline__ uint4 pack_vec<__nv_bfloat16>(const float (&f)[8]) {
  return make_uint4(pack2<__nv_bfloat16>(f[0], f[1]), pack2<__nv_bfloat16>(f[2], f[3]),
                    pack2<__nv_bfloat16>(f[4], f[5]), pack2<__nv_bfloat16>(f[6], f[7]));
}

// Read-only 16-byte global load through the non-coherent path (the data is not written during the kernel).
__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// ---- reductions -------------------------------------------------------------------------------------------------
// Butterfly over lanes that differ in the bits [lo, hi): afterwards every lane holds the group's result.
template <int LO, int HI> __device__ __forceinline__ float warp_sum_range(float v) {
#pragma unroll
  for (int o = LO; o < HI; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <int LO, int HI> __device__ __forceinline__ float warp_max_range(float v) {
#pragma unroll
  for (int o = LO; o < HI; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole thread block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` must hold 32 floats; the call ends with a barrier, so scratch can be reused after it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  v = warp_sum_range<1, 32>(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = lane < num_warps ? scratch[lane] : 0.f;
  total = warp_sum_range<1, 32>(total);
  __syncthreads();
  return total;
}

// ---- PTX wrappers (sm_80+) --------------------------------------------------------------------------------------
// tests/simt (the host emulator that runs these kernels on a CPU in make test) defines PAGEDSERVE_SIMT_HOST and
// supplies its own versions of everything in this section, with the same semantics.
#ifndef PAGEDSERVE_SIMT_HOST
// Bytes of dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned int dynamic_smem_bytes() {
  unsigned int bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// 16-byte async global->shared copy; when `pred` is false nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
// The "memory" clobbers keep the compiler from moving ordinary shared-memory accesses across these.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices from shared memory; lane l supplies the address of row (l & 7) of matrix (l >> 3).
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem))
               : "memory");
}

// D = A(16x16, row) * B(16x8, col) + D with fp32 accumulators (PTX ISA, mma.m16n8k16 fragment layouts).
template <typename T> __device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned int (&a)[4],
                                                                unsigned int b0, unsigned int b1);
template <> __device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned int (&a)[4],
                                                              unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned int (&a)[4],
                                                                     unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif  // PAGEDSERVE_SIMT_HOST

}  // namespace pagedserve
