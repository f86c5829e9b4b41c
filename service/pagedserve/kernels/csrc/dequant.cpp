// dequantize_q4, dequantize_q8: a quantized weight (linear.hpp's q4 / q8 formats) decoded to float32 [N, K], for the
// prefill path of the quantized linears: at M tokens a linear does 2 * M * N * K flops against N * K decoded weights,
// so from some tens of tokens up decoding the weight once per call and handing it to the BLAS's float32 GEMM (the
// machine's full FMA width: AVX-512 where it has it, which these AVX2 kernels do not use) costs less than any
// kernel that decodes weights in its inner loop; and the result is the float32 function of the quantized weights
// itself (no rounding of the activations). Rows split over ATen's threads.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "linear.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kDequantRowGrain = 16;   // rows per parallel work item at least

// One run of 32 q4 weights (16 bytes, low nibbles first) -> out[0:32] = q * s + m.
inline void decode_q4_run(const uint8_t* codes, float s, float m, float* out) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
  const __m128i halves[2] = {lo, hi};
  for (int h = 0; h < 2; ++h) {
    const __m256i q0 = _mm256_cvtepu8_epi32(halves[h]), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(halves[h], 8));
    _mm256_storeu_ps(out + 16 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), sv, mv));
    _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), sv, mv));
  }
}

}  // namespace

at::Tensor dequantize_q4(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                         int64_t group_size) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K / 2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, groups = K / std::max<int64_t>(group_size, 1);
  check_groups(scale, N, K, group_size, "scale");
  check_groups(min, N, K, group_size, "min");
  at::Tensor out = at::empty({N, K}, scale.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float *sc = scale.data_ptr<float>(), *mn = min.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, kDequantRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; k += 32) {
        const int64_t g = n * groups + k / group_size;
        decode_q4_run(c + n * (K / 2) + k / 2, sc[g], mn[g], o + n * K + k);
      }
  });
  return out;
}

at::Tensor dequantize_q8(const at::Tensor& codes, const at::Tensor& scale, int64_t group_size) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), groups = K / std::max<int64_t>(group_size, 1);
  TORCH_CHECK(K % 8 == 0, "K must be a multiple of 8, got ", K);
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && K % group_size == 0,
              "group_size must be a positive multiple of 8 dividing K, got ", group_size);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == N && scale.size(1) == groups,
              "scale must be contiguous float32 [N, K / group_size]");
  at::Tensor out = at::empty({N, K}, scale.options());
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, kDequantRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; k += 8) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + n * K + k));
        const __m256 s = _mm256_set1_ps(sc[n * groups + k / group_size]);
        _mm256_storeu_ps(o + n * K + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s));
      }
  });
  return out;
}

}  // namespace pagedserve::cpu
