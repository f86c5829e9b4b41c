// The quantized linears (linear_q4, linear_q8): rows decoded in registers and multiplied at once for a few tokens,
// decoded into an L1 row buffer and multiplied in register tiles for more (formats and paths: linear.hpp).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "linear.hpp"
#include "linear_fused512.hpp"
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

// Few tokens (T <= kFusedTokens): a quantized row is decoded in registers and multiplied at once, never stored.
// out[t * N + n] = sum_g scale[n, g] * dot(q[n, g], x[t, g]) + sum_g min[n, g] * xsum[t, g] (+ bias[n]), where
// xsum[t, g] is the sum of token t's activations over group g (q4: w = q * scale + min; q8 has no min).
constexpr int64_t kFusedTokens = 4;
// Rows prefetched ahead on the fused path: the hardware prefetchers lose the three streams (codes, scales, mins)
// at page ends; same-process A/B at M=1 on the Q8_0 LM head 1.19-1.30x (2, 4, 8 rows ahead), 120 Q4 layers
// 1.00-1.05x.
constexpr int64_t kPrefetchRows = 4;

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

// sum[t] = scale * dot(w[g], x[t, g]) for group g of one row, added into acc[t] (register arrays: T and the loop
// bounds are compile-time, so nothing here is indexed at run time).
template <bool kQ4, int T>
inline void group_fma(const uint8_t* codes, const float* x, int64_t K, int64_t k0, int64_t k1, float scale,
                      __m256 acc[T]) {
  __m256 a0[T], a1[T];
  for (int t = 0; t < T; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k += 32) {
    __m256 w[4];
    if constexpr (kQ4) decode_q4_32(codes + k / 2, w);
    else decode_q8_32(reinterpret_cast<const int8_t*>(codes) + k, w);
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * K + k;
      a0[t] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xt), a0[t]);
      a1[t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), a1[t]);
      a0[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), a0[t]);
      a1[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), a1[t]);
    }
  }
  const __m256 s = _mm256_set1_ps(scale);
  for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(_mm256_add_ps(a0[t], a1[t]), s, acc[t]);
}

template <bool kQ4, int T>
void fused_row(const uint8_t* codes, const float* scale, const float* min, int64_t K, int64_t group_size,
               const float* x, const float* xsum, float* out, int64_t N, int64_t n, const float* bias) {
  const int64_t groups = K / group_size;
  // One or two tokens: two running totals per token (even and odd groups), so the chain of per-group FMAs is not
  // the critical path; with more tokens the tokens' chains already interleave (and registers run out).
  __m256 even[T], odd[T];
  for (int t = 0; t < T; ++t) even[t] = odd[t] = _mm256_setzero_ps();
  int64_t g = 0;
  if constexpr (T <= 2) {
    for (; g + 2 <= groups; g += 2) {
      group_fma<kQ4, T>(codes, x, K, g * group_size, (g + 1) * group_size, scale[g], even);
      group_fma<kQ4, T>(codes, x, K, (g + 1) * group_size, (g + 2) * group_size, scale[g + 1], odd);
    }
  }
  for (; g < groups; ++g) group_fma<kQ4, T>(codes, x, K, g * group_size, (g + 1) * group_size, scale[g], even);
  for (int t = 0; t < T; ++t) {
    float y = hsum(_mm256_add_ps(even[t], odd[t])) + (bias ? bias[n] : 0.0f);
    if constexpr (kQ4) y += dot(min, xsum + t * groups, groups);
    out[t * N + n] = y;
  }
}

template <bool kQ4, int T>
void fused_rows(const uint8_t* codes, const float* scale, const float* min, int64_t K, int64_t group_size,
                const float* x, const float* xsum, float* out, int64_t N, const float* bias) {
  const int64_t groups = K / group_size, row_bytes = kQ4 ? K / 2 : K;
  auto* row_fn = fused512_enabled() ? &fused_row512<kQ4, T> : &fused_row<kQ4, T>;   // linear_fused512.hpp
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (n + kPrefetchRows < end) {   // software prefetch of a row ahead: codes, scales, mins (see below)
        const int64_t a = n + kPrefetchRows;
        const char* p = reinterpret_cast<const char*>(codes + a * row_bytes);
        for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(scale + a * groups), _MM_HINT_T0);
        if constexpr (kQ4) _mm_prefetch(reinterpret_cast<const char*>(min + a * groups), _MM_HINT_T0);
      }
      row_fn(codes + n * row_bytes, scale + n * groups, kQ4 ? min + n * groups : nullptr, K, group_size, x, xsum,
             out, N, n, bias);
    }
  });
}

// Dispatch on the token count; x [M, K] with M <= kFusedTokens.
template <bool kQ4>
void run_fused(const uint8_t* codes, const float* scale, const float* min, int64_t K, int64_t group_size,
               const float* x, int64_t M, float* out, int64_t N, const float* bias) {
  const int64_t groups = K / group_size;
  std::vector<float> xsum(kQ4 ? M * groups : 0);
  for (int64_t t = 0; kQ4 && t < M; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + t * K + k));
      xsum[t * groups + g] = hsum(s);
    }
  switch (M) {
    case 1: fused_rows<kQ4, 1>(codes, scale, min, K, group_size, x, xsum.data(), out, N, bias); break;
    case 2: fused_rows<kQ4, 2>(codes, scale, min, K, group_size, x, xsum.data(), out, N, bias); break;
    case 3: fused_rows<kQ4, 3>(codes, scale, min, K, group_size, x, xsum.data(), out, N, bias); break;
    default: fused_rows<kQ4, 4>(codes, scale, min, K, group_size, x, xsum.data(), out, N, bias); break;
  }
}

// Quantized weights, M > kFusedTokens: each kQuantRows rows are decoded once per token block into a row buffer
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
  if (M <= kFusedTokens) {
    run_fused<true>(codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), min.data_ptr<float>(), K, group_size,
                    x.data_ptr<float>(), M, out.data_ptr<float>(), N, bias ? bias->data_ptr<float>() : nullptr);
    return out;
  }
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
  if (M <= kFusedTokens) {
    run_fused<false>(reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), scale.data_ptr<float>(), nullptr,
                     K, group_size, x.data_ptr<float>(), M, out.data_ptr<float>(), N,
                     bias ? bias->data_ptr<float>() : nullptr);
    return out;
  }
  run_row_tiles(Q8Rows{codes.data_ptr<int8_t>(), scale.data_ptr<float>(), K, group_size}, x.data_ptr<float>(), M, K, N,
      out.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr);
  return out;
}

bool linear_avx512(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "mode must be -1 (query), 0 (off) or 1 (on where the CPU has AVX-512)");
  if (mode >= 0)
    fused512_enabled() = mode == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return fused512_enabled();
}

}  // namespace pagedserve::cpu
