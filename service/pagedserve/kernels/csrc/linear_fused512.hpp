// The fused path of the quantized linears (linear_quant.cpp: a row decoded in registers and multiplied at once, for
// 1-4 tokens: decode steps) on AVX-512, runtime-dispatched: the build targets AVX2 and only these functions are
// compiled for AVX-512 (target attributes), taken where the CPU reports AVX-512F/BW/DQ/VL unless turned off (torch op
// pagedserve_cpu::linear_avx512, for tests and A/B runs). A run of 32 weights is two 16-float vectors: a q4 run's
// 16 bytes widen to 16 int32 lanes in one instruction, whose low nibbles are weights 0-15 and high nibbles 16-31
// (GGUF's order), so the decode is 6 instructions per 32 weights against 12 on AVX2, and the FMAs half as many.
#pragma once

#include <cstdint>

#include "cpu_types.hpp"

namespace pagedserve::cpu {

// Whether the fused path takes the AVX-512 functions below.
inline bool& fused512_enabled() {
  static bool enabled = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return enabled;
}

#define PAGEDSERVE_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl")))

// acc[t] += scale * dot(w[k0:k1], x[t, k0:k1]) for one row's group (group_fma's contract, 16 lanes).
template <bool kQ4, int T>
PAGEDSERVE_AVX512 inline void group_fma512(const uint8_t* codes, const float* x, int64_t K, int64_t k0, int64_t k1,
                                           float scale, __m512 acc[T]) {
  __m512 a0[T], a1[T];
  for (int t = 0; t < T; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 32) {
    __m512 w0, w1;
    if constexpr (kQ4) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2)));
      w0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
      w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(codes) + k;
      w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
      w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
    }
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * K + k;
      a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), a0[t]);
      a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), a1[t]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int t = 0; t < T; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(a0[t], a1[t]), s, acc[t]);
}

// fused_row's contract (linear_quant.cpp): out[t * N + n] for one row n and T tokens; xsum [T, groups] for q4's min.
template <bool kQ4, int T>
PAGEDSERVE_AVX512 __attribute__((noinline)) void fused_row512(const uint8_t* codes, const float* scale,
                                                              const float* min, int64_t K, int64_t group_size,
                                                              const float* x, const float* xsum, float* out,
                                                              int64_t N, int64_t n, const float* bias) {
  const int64_t groups = K / group_size;
  __m512 even[T], odd[T];   // two chains per token for 1-2 tokens, as fused_row
  for (int t = 0; t < T; ++t) even[t] = odd[t] = _mm512_setzero_ps();
  int64_t g = 0;
  if constexpr (T <= 2) {
    for (; g + 2 <= groups; g += 2) {
      group_fma512<kQ4, T>(codes, x, K, g * group_size, (g + 1) * group_size, scale[g], even);
      group_fma512<kQ4, T>(codes, x, K, (g + 1) * group_size, (g + 2) * group_size, scale[g + 1], odd);
    }
  }
  for (; g < groups; ++g) group_fma512<kQ4, T>(codes, x, K, g * group_size, (g + 1) * group_size, scale[g], even);
  for (int t = 0; t < T; ++t) {
    float y = _mm512_reduce_add_ps(_mm512_add_ps(even[t], odd[t])) + (bias ? bias[n] : 0.0f);
    if constexpr (kQ4) y += dot(min, xsum + t * groups, groups);
    out[t * N + n] = y;
  }
}

#undef PAGEDSERVE_AVX512

}  // namespace pagedserve::cpu
