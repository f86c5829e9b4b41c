// The KV cache's element types (--kv-cache-dtype: float32, float16, bfloat16), shared by the decode-attention kernel
// (attention.cpp, which widens rows on load) and the KV write (cache.cpp, which rounds rows on store).
#pragma once

#include <ATen/Dispatch.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace pagedserve::cpu {

inline bool is_cache_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// ATen's dispatch over the cache types above: the body sees the element type as scalar_t.
#define PAGEDSERVE_CACHE_TYPE_CASES(...)       \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
  AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)     \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)

// Load: float32 as is; float16 (F16C) and bfloat16 (the upper 16 bits of a float32) widened exactly to float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// One float32 row of n (a multiple of 8) into the cache's type: float16 rounds to nearest even (F16C), bfloat16
// likewise (NaN stays a quiet NaN), as torch's .to() does.
inline void store_row(const float* src, int64_t n, float* dst) { std::copy_n(src, n, dst); }
inline void store_row(const float* src, int64_t n, at::Half* dst) {
  for (int64_t i = 0; i < n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store_row(const float* src, int64_t n, at::BFloat16* dst) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), qnan = _mm256_set1_epi32(0x7FC0);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256i b = _mm256_castps_si256(x);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    // 8 x 32-bit lanes holding 16-bit values -> 8 x 16 bits (packus works per 128-bit half, so fix the order)
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
}

}  // namespace pagedserve::cpu
