// The quantized linears with float32 activations (linear_q4, linear_q8): rows decoded into an L1 row buffer and
// multiplied in register tiles, for every token count (formats and paths: linear.hpp).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "linear.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

// Decoders: row n of the weight as float32 into dst[K].
struct Q4Rows {
  const uint8_t* codes;
  const float* scale;
  const float* min;
  int64_t K, group_size;
  const float* row(int64_t n, float* dst) const;
};

struct Q8Rows {
  const int8_t* codes;
  const float* scale;
  int64_t K, group_size;
  const float* row(int64_t n, float* dst) const;
};

// 32 Q4 weights (16 bytes) as 4 x 8 floats in order: bytes 0-7 and 8-15 zero-extended to 32 bits straight from
// memory (two shuffles instead of four), their low nibbles weights 0-15, high nibbles weights 16-31.
inline void decode_q4_32(const uint8_t* q, __m256 v[4]) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
  v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low4));
  v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
  v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

const float* Q4Rows::row(int64_t n, float* dst) const {
  const uint8_t* q = codes + n * (K / 2);
  const int64_t groups = K / group_size;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(scale[n * groups + g]), b = _mm256_set1_ps(min[n * groups + g]);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 32) {
      __m256 v[4];
      decode_q4_32(q + k / 2, v);
      for (int p = 0; p < 4; ++p) _mm256_storeu_ps(dst + k + 8 * p, _mm256_fmadd_ps(v[p], s, b));
    }
  }
  return dst;
}

inline void decode_q8_32(const int8_t* q, __m256 v[4]) {
  for (int p = 0; p < 4; ++p)
    v[p] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p))));
}

const float* Q8Rows::row(int64_t n, float* dst) const {
  const int8_t* q = codes + n * K;
  const int64_t groups = K / group_size;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(scale[n * groups + g]);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 32) {
      __m256 v[4];
      decode_q8_32(q + k, v);
      for (int p = 0; p < 4; ++p) _mm256_storeu_ps(dst + k + 8 * p, _mm256_mul_ps(v[p], s));
    }
  }
  return dst;
}

// Quantized weights, every token count (one scheme, so a row's result never depends on M): each kQuantRows rows are decoded once per token block into a row buffer
// (float32, row-major: no transpose) that stays in L1, then every token of the block is multiplied against them in
// register tiles of kQuantRows rows x kQuantTokens tokens (12 accumulators, k in the vector lanes, one horizontal sum
// per output). Against the float32 panel path (linear_f32.cpp) this does less work per decoded weight (no transpose,
// no second store and load) and so wins where the decoding is a large share, at 5-48 tokens: 120 Q4 linears of the
// embedded model, same process, 1.23x at M = 16, 1.13x at 48, 1.00-1.10x at 96-256 (bench/README.md, quant section).
// Tokens go in blocks of kTokenBlock (linear.hpp).
constexpr int kQuantRows = 4;
constexpr int kQuantTokens = 3;

template <class Rows>
void run_row_tiles(const Rows& rows, const float* x, int64_t M, int64_t K, int64_t N, float* out,
                   const float* bias) {
  const int64_t units = (N + kQuantRows - 1) / kQuantRows;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rowbuf(kQuantRows * K);
    for (int64_t m0 = 0; m0 < M; m0 += kTokenBlock) {
      const int64_t mt = std::min(kTokenBlock, M - m0);
      const float* xb = x + m0 * K;
      float* ob = out + m0 * N;
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t n0 = unit * kQuantRows, r = std::min<int64_t>(kQuantRows, N - n0);
        const float* w[kQuantRows];
        for (int64_t i = 0; i < r; ++i) w[i] = rows.row(n0 + i, rowbuf.data() + i * K);
        switch (r) {
          case 4: rows_times_tokens<4, kQuantTokens>(w, xb, mt, K, ob, N, n0, bias); break;
          case 3: rows_times_tokens<3, kQuantTokens>(w, xb, mt, K, ob, N, n0, bias); break;
          case 2: rows_times_tokens<2, kQuantTokens>(w, xb, mt, K, ob, N, n0, bias); break;
          default: rows_times_tokens<1, kQuantTokens>(w, xb, mt, K, ob, N, n0, bias); break;
        }
      }
    }
  });
}

}  // namespace

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                     int64_t group_size, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K / 2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, M = x.size(0);
  check_input(x, K, bias, N);
  check_groups(scale, N, K, group_size, "scale");
  check_groups(min, N, K, group_size, "min");
  at::Tensor out = at::empty({M, N}, x.options());
  run_row_tiles(Q4Rows{codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), min.data_ptr<float>(), K, group_size},
      x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr);
  return out;
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t group_size,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), M = x.size(0);
  check_input(x, K, bias, N);
  check_groups(scale, N, K, group_size, "scale");
  at::Tensor out = at::empty({M, N}, x.options());
  run_row_tiles(Q8Rows{codes.data_ptr<int8_t>(), scale.data_ptr<float>(), K, group_size}, x.data_ptr<float>(), M, K, N,
      out.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr);
  return out;
}

}  // namespace pagedserve::cpu
