// The int8-activation tile (linear_a8.hpp's a8_tile) on AVX-VNNI, runtime-dispatched: the build targets AVX2, and
// only this function is compiled for AVX-VNNI (a target attribute), called where the CPU reports it
// (__builtin_cpu_supports("avxvnni"); Intel Alder Lake / Sapphire Rapids and later, AMD Zen 5). vpdpbusd does
// maddubs + the int16/int32 widening of one step in one instruction, so the integer work per 4 weights x 8 rows
// x 1 token is one instruction instead of two (q4) or four (q8).
#pragma once

#include "linear_a8.hpp"

namespace pagedserve::cpu {

// Whether linear_q4_a8 / linear_q8_a8 take the AVX-VNNI tile: true where the CPU has it, unless turned off
// (torch op pagedserve_cpu::linear_a8_vnni, for tests and A/B runs).
inline bool& a8_vnni_enabled() {
  static bool enabled = __builtin_cpu_supports("avxvnni");
  return enabled;
}

// Same contract as a8_tile (and the same bits: the integer sums are exact either way).
template <bool kQ4, int T, int L>
__attribute__((target("avx2,fma,avxvnni"), noinline)) void a8_tile_vnni(
    const uint8_t* codes, const float* dw, const float* mw, int64_t nb, const int8_t* const* a, int64_t lda,
    const float* d, const float* s, int64_t ldd, __m256 acc[T]) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = codes + b * (kActBlock * kPanelRows);
    __m256i isum[L][T];
    for (int l = 0; l < L; ++l)
      for (int t = 0; t < T; ++t) isum[l][t] = _mm256_setzero_si256();
    for (int j = 0; j < kActBlock / 4; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
      if constexpr (kQ4) {
        for (int l = 0; l < L; ++l)
          for (int t = 0; t < T; ++t)
            isum[l][t] = _mm256_dpbusd_avx_epi32(isum[l][t], w, bcast4(a[l] + t * lda + b * kActBlock + 4 * j));
      } else {   // |w| against x carrying w's sign, as in a8_tile
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int l = 0; l < L; ++l)
          for (int t = 0; t < T; ++t)
            isum[l][t] = _mm256_dpbusd_avx_epi32(
                isum[l][t], aw, _mm256_sign_epi8(bcast4(a[l] + t * lda + b * kActBlock + 4 * j), w));
      }
    }
    const __m256 dwb = _mm256_loadu_ps(dw + b * kPanelRows);
    for (int t = 0; t < T; ++t) {
      const __m256i i32 = L > 1 ? two_digits(isum[0][t], isum[L - 1][t]) : isum[0][t];
      const __m256 scale = _mm256_mul_ps(dwb, _mm256_broadcast_ss(d + t * ldd + b));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), scale, acc[t]);
      if constexpr (kQ4)
        acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(mw + b * kPanelRows), _mm256_broadcast_ss(s + t * ldd + b), acc[t]);
    }
  }
}

}  // namespace pagedserve::cpu
