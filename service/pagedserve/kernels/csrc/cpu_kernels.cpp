// pagedserve's CPU kernels for x86-64 with AVX2 + FMA: the weight-streaming linears below and, at the end, a paged
// decode-attention kernel (paged_decode_attention).
//
// Linears: y[M, N] = x[M, K] . W[N, K]^T (+ bias), float32
// activations and accumulation, W stored as float32, as 4-bit codes with a scale and a min per group, or as int8
// codes with a scale per group.
//
// Why: at decode (M = 1..64 tokens) a linear is bound by how fast its weights stream from memory; torch's fp32 GEMM
// reaches about a third of this machine's read bandwidth there, and its int4/int8 CPU kernels are vectorized only for
// bfloat16 activations on AVX2. Paths, by token count M:
//   - quantized, M <= 4 (kFusedTokens): each row decoded in registers and multiplied at once (fused_row);
//   - quantized, M >= 5: 4 rows at a time decoded into a row buffer in L1, then register tiles of 4 rows x 3
//     tokens with k in vector lanes and horizontal sums (run_row_tiles);
//   - float32, M <= 4: a register tile of kRows rows x up to 4 tokens with horizontal sums, weights read in place
//     (run);
//   - float32, M >= 5 (kPanelMinTokens): 8 rows at a time transposed into a panel [K][8] in L1/L2, then a
//     register tile of 16 rows x 6 tokens with the rows in vector lanes (run_panels).
//
// Formats (row-major, one row per output channel n):
//   f32: W float32 [N, K].
//   q4:  codes uint8 [N, K / 2]: each run of 32 weights is 16 bytes, byte j holding weight j in its low nibble and
//        weight j + 16 in its high nibble (GGUF Q4_0/Q4_1's order); w = q * scale[n, g] + min[n, g], q in 0..15,
//        g = k / group_size; scale, min float32 [N, K / group_size].
//   q8:  codes int8 [N, K]; w = q * scale[n, g], scale float32 [N, K / group_size].
// Threads: ATen's intra-op pool (at::parallel_for) over tiles of output rows, so the kernels share torch's threads.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kRows = 3;          // output rows per register tile of the few-token float32 path (run)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two parts for an exact reduction), e^r by its
// degree-6 Taylor polynomial (relative error below 2e-7 on that interval), 2^n built in the exponent bits. Inputs
// below -87.3 give 0 (subnormals flushed); above 88.7, +inf.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7228f), lo = _mm256_set1_ps(-87.3365f);
  const __m256 xc = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
}

// out[m * ldo + n0 + r] = dot(w[r], x[m]) + bias for R rows and T tokens (T <= 4), K a multiple of 8.
template <int R, int T>
inline void tile(const float* const* w, const float* x, int64_t ldx, int64_t K, float* out, int64_t ldo,
                 int64_t n0, const float* bias) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w[r] + k);
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      out[t * ldo + n0 + r] = hsum(acc[r][t]) + (bias ? bias[n0 + r] : 0.0f);
}

// Every token of x [M, K] times R rows: tiles of T tokens (T <= 4), then one tile of the M % T left.
template <int R, int T = 4>
inline void rows_times_tokens(const float* const* w, const float* x, int64_t M, int64_t K, float* out, int64_t N,
                              int64_t n0, const float* bias) {
  int64_t m = 0;
  for (; m + T <= M; m += T) tile<R, T>(w, x + m * K, K, K, out + m * N, N, n0, bias);
  switch (M - m) {
    case 3: if constexpr (T > 3) tile<R, 3>(w, x + m * K, K, K, out + m * N, N, n0, bias); break;
    case 2: if constexpr (T > 2) tile<R, 2>(w, x + m * K, K, K, out + m * N, N, n0, bias); break;
    case 1: tile<R, 1>(w, x + m * K, K, K, out + m * N, N, n0, bias); break;
    default: break;
  }
}

// Decoders: row n of the weight as float32 into dst[K] (or a pointer to it when stored as float32).
struct F32Rows {
  const float* w;
  int64_t K;
  const float* row(int64_t n, float*) const { return w + n * K; }
};

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

// dot(a[0:n], b[0:n]) with 8-wide FMAs (the min term: sum_g min[g] * xsum[g]).
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float y = hsum(acc);
  for (; i < n; ++i) y += a[i] * b[i];
  return y;
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
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (n + kPrefetchRows < end) {   // software prefetch of a row ahead: codes, scales, mins (see below)
        const int64_t a = n + kPrefetchRows;
        const char* p = reinterpret_cast<const char*>(codes + a * row_bytes);
        for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(scale + a * groups), _MM_HINT_T0);
        if constexpr (kQ4) _mm_prefetch(reinterpret_cast<const char*>(min + a * groups), _MM_HINT_T0);
      }
      fused_row<kQ4, T>(codes + n * row_bytes, scale + n * groups, kQ4 ? min + n * groups : nullptr, K, group_size,
                        x, xsum, out, N, n, bias);
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

// Float32 weights, M < kPanelMinTokens tokens: kRows rows at a time read in place, times every token.
void run(const F32Rows& rows, const float* x, int64_t M, int64_t K, int64_t N, float* out, const float* bias) {
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile_idx = begin; tile_idx < end; ++tile_idx) {
      const int64_t n0 = tile_idx * kRows;
      const int64_t r = std::min(kRows, N - n0);
      const float* w[kRows];
      for (int64_t i = 0; i < r; ++i) w[i] = rows.row(n0 + i, nullptr);
      if (r == 3) rows_times_tokens<3>(w, x, M, K, out, N, n0, bias);
      else if (r == 2) rows_times_tokens<2>(w, x, M, K, out, N, n0, bias);
      else rows_times_tokens<1>(w, x, M, K, out, N, n0, bias);
    }
  });
}

// Quantized weights, M > kFusedTokens: each kQuantRows rows are decoded once per token block into a row buffer
// (float32, row-major: no transpose) that stays in L1, then every token of the block is multiplied against them in
// register tiles of kQuantRows rows x kQuantTokens tokens (12 accumulators, k in the vector lanes, one horizontal sum
// per output). Against the panel path below this does less work per decoded weight (no transpose, no second store
// and load) and so wins where the decoding is a large share, at 5-48 tokens: 120 Q4 linears of the embedded model,
// same process, 1.23x at M = 16, 1.13x at 48, 1.00-1.10x at 96-256 (bench/README.md, quant section).
constexpr int kQuantRows = 4;
constexpr int kQuantTokens = 3;
constexpr int64_t kTokenBlock = 96;   // tokens per block: a long prefill chunk's activations stay in L2

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

// Float32 weights, M >= kPanelMinTokens: rows in vector lanes. Each 8 output rows are read in place and transposed
// once into a panel [K][8] in a per-thread buffer; a register tile of 2 panels (16 rows) x
// up to 6 tokens (12 accumulators) then walks k, broadcasting one activation per token: no horizontal sums, each
// token's x row read once per 16 rows, and the results are stored 8 contiguous outputs at a time.
constexpr int64_t kPanelMinTokens = 5;
constexpr int kPanelTokens = 6;

// In-register transpose of an 8 x 8 float block: r[i][j] -> r[j][i].
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// panel[k * 8 + i] = row n0 + i of the weight at k (rows past N are zero).
void build_panel(const F32Rows& rows, int64_t n0, int64_t N, int64_t K, const float* zeros, float* panel) {
  const float* src[8];
  for (int i = 0; i < 8; ++i) src[i] = n0 + i < N ? rows.row(n0 + i, nullptr) : zeros;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i] + k);
    transpose8(r);
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(panel + (k + j) * 8, r[j]);
  }
}

// out[t, n0 : n0 + 8 * NP] (only columns < N) = x[t] . panels (+ bias) for T tokens.
// k runs in chunks of kPanelChunk: each chunk's sums start from zero in registers and are then added to the tile's
// totals in L1, so a K-term dot product is rounded as ~kPanelChunk + K / kPanelChunk additions deep instead of K
// (the register-tile path's 8 interleaved lanes give K / 8; the model's logits must stay within 1e-4 of HF's).
constexpr int64_t kPanelChunk = 32;

template <int NP, int T>
void panel_tile(const float* panel, int64_t K, const float* x, float* out, int64_t N, int64_t n0,
                const float* bias) {
  alignas(32) float res[NP][T][8];
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) _mm256_store_ps(res[p][t], _mm256_setzero_ps());
  for (int64_t k0 = 0; k0 < K; k0 += kPanelChunk) {
    const int64_t k1 = std::min(K, k0 + kPanelChunk);
    __m256 acc[NP][T];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[p][t] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      __m256 w[NP];
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) w[p] = _mm256_loadu_ps(panel + (p * K + k) * 8);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const __m256 xb = _mm256_broadcast_ss(x + t * K + k);
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) acc[p][t] = _mm256_fmadd_ps(w[p], xb, acc[p][t]);
      }
    }
    // constant indices only, so the accumulators above stay in registers
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) _mm256_store_ps(res[p][t], _mm256_add_ps(_mm256_load_ps(res[p][t]), acc[p][t]));
  }
  for (int p = 0; p < NP; ++p) {   // the columns that exist, plus bias
    const int64_t c = n0 + 8 * p, valid = std::min<int64_t>(8, N - c);
    for (int t = 0; t < T; ++t)
      for (int64_t i = 0; i < valid; ++i) out[t * N + c + i] = res[p][t][i] + (bias ? bias[c + i] : 0.0f);
  }
}

template <int NP>
void panel_tokens(const float* panel, int64_t K, const float* x, int64_t M, float* out, int64_t N, int64_t n0,
                  const float* bias) {
  int64_t m = 0;
  for (; m + kPanelTokens <= M; m += kPanelTokens)
    panel_tile<NP, kPanelTokens>(panel, K, x + m * K, out + m * N, N, n0, bias);
  const float* xs = x + m * K;
  float* os = out + m * N;
  switch (M - m) {
    case 5: panel_tile<NP, 5>(panel, K, xs, os, N, n0, bias); break;
    case 4: panel_tile<NP, 4>(panel, K, xs, os, N, n0, bias); break;
    case 3: panel_tile<NP, 3>(panel, K, xs, os, N, n0, bias); break;
    case 2: panel_tile<NP, 2>(panel, K, xs, os, N, n0, bias); break;
    case 1: panel_tile<NP, 1>(panel, K, xs, os, N, n0, bias); break;
    default: break;
  }
}

void run_panels(const F32Rows& rows, const float* x, int64_t M, int64_t K, int64_t N, float* out,
                const float* bias) {
  const int64_t units = (N + 15) / 16;   // 16 output rows (two panels) per work unit
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> zeros(K, 0.0f), panel(16 * K);
    // Token blocks of kTokenBlock, so that a long prefill chunk's activations stay in L2 while every unit
    // of this thread passes over them (the panels are built again per block).
    for (int64_t m0 = 0; m0 < M; m0 += kTokenBlock) {
      const int64_t mt = std::min(kTokenBlock, M - m0);
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t n0 = unit * 16;
        build_panel(rows, n0, N, K, zeros.data(), panel.data());
        if (N - n0 > 8) {
          build_panel(rows, n0 + 8, N, K, zeros.data(), panel.data() + 8 * K);
          panel_tokens<2>(panel.data(), K, x + m0 * K, mt, out + m0 * N, N, n0, bias);
        } else {
          panel_tokens<1>(panel.data(), K, x + m0 * K, mt, out + m0 * N, N, n0, bias);
        }
      }
    }
  });
}

void check_input(const at::Tensor& x, int64_t K, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [M, K]");
  TORCH_CHECK(x.size(1) == K, "x has K=", x.size(1), ", the weight K=", K);
  TORCH_CHECK(K % 8 == 0, "K must be a multiple of 8, got ", K);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float32 tensor [N]");
  }
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be contiguous float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_input(x, K, bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
  const F32Rows rows{w.data_ptr<float>(), K};
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (M >= kPanelMinTokens) run_panels(rows, x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), b);
  else run(rows, x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), b);
  return out;
}

void check_groups(const at::Tensor& t, int64_t N, int64_t K, int64_t group_size, const char* what) {
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == N &&
                  t.size(1) == K / group_size,
              what, " must be contiguous float32 [N, K / group_size]");
}

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

// Paged decode attention: one query token per sequence against its whole context in the paged KV cache, read in
// place through the block table (no gather). out[s, h] = softmax(scale * q[s, h] . K[s, :, h / G]) V[s, :, h / G]
// with G = H / Hkv query heads per KV head (GQA). Work item: (sequence, query head), so that even one sequence
// spreads over the threads; the G heads of one KV head are adjacent items, so a thread mostly reads a K/V row
// from L1/L2 after its first head. Scores go to a per-thread buffer [context]; softmax in float32 with the row
// maximum subtracted (exp8). Context rows are walked a cache block at a time (no per-token division).

inline bool is_cache_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// ATen's dispatch over the cache types above: the body sees the element type as scalar_t.
#define PAGEDSERVE_CACHE_TYPE_CASES(...)       \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
  AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)     \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)

// Sums of 4 vectors as one 4-float vector: [hsum(a0), hsum(a1), hsum(a2), hsum(a3)].
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// KV cache element types: float32 as is; float16 (F16C) and bfloat16 (the upper 16 bits of a float32) widened
// exactly to float32 on load (--kv-cache-dtype).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

template <class C>
struct DecodeArgs {
  const float* q;
  const C *k, *v;
  const int32_t *tables, *lens;
  float* out;
  int64_t H, Hkv, D, block_size, max_blocks;
  float scale;
};

// One (sequence s, query head h); DV = D / 8 vectors per row (DV = 0: D read at run time); C the cache type.
template <int DV, class C>
void decode_head(const DecodeArgs<C>& a, int64_t s, int64_t h, std::vector<float>& scores) {
  const int64_t D = DV ? DV * 8 : a.D, nv = D / 8, len = a.lens[s], G = a.H / a.Hkv, kvh = h / G;
  const int64_t row_stride = a.Hkv * D, bs = a.block_size;
  const int32_t* table = a.tables + s * a.max_blocks;
  const float* qh = a.q + (s * a.H + h) * D;
  scores.resize(len);
  float* row = scores.data();
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const C* k0 = a.k + (static_cast<int64_t>(table[t0 / bs]) * bs * a.Hkv + kvh) * D;
    const int64_t n = std::min(bs, len - t0);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {       // four tokens at a time: one reduction for four scores
      const C* kr = k0 + i * row_stride;
      __m256 acc[4];
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < nv; ++d) {
        const __m256 qv = _mm256_loadu_ps(qh + 8 * d);
        for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(kr + j * row_stride + 8 * d), acc[j]);
      }
      _mm_storeu_ps(row + t0 + i, _mm_mul_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(a.scale)));
    }
    for (; i < n; ++i) {
      const C* kr = k0 + i * row_stride;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < nv; ++d) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * d), load8(kr + 8 * d), acc);
      row[t0 + i] = hsum(acc) * a.scale;
    }
  }
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(row + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx8);
  float mx = *std::max_element(lanes, lanes + 8);
  for (; t < len; ++t) mx = std::max(mx, row[t]);
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), mxv));
    _mm256_storeu_ps(row + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; t < len; ++t) {
    row[t] = std::exp(row[t] - mx);
    sum += row[t];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  float* o = a.out + (s * a.H + h) * D;
  for (int64_t d0 = 0; d0 < nv; d0 += 8) {   // the output in chunks of up to 8 vectors held in registers
    const int64_t m = std::min<int64_t>(8, nv - d0);
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t u0 = 0; u0 < len; u0 += bs) {
      const C* vr = a.v + (static_cast<int64_t>(table[u0 / bs]) * bs * a.Hkv + kvh) * D + 8 * d0;
      const int64_t n = std::min(bs, len - u0);
      for (int64_t i = 0; i < n; ++i, vr += row_stride) {
        const __m256 p = _mm256_set1_ps(row[u0 + i]);
        if (DV == 8) {
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(p, load8(vr + 8 * j), acc[j]);
        } else {
          for (int j = 0; j < m; ++j) acc[j] = _mm256_fmadd_ps(p, load8(vr + 8 * j), acc[j]);
        }
      }
    }
    for (int j = 0; j < m; ++j) _mm256_storeu_ps(o + 8 * (d0 + j), _mm256_mul_ps(acc[j], inv));
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be float32 [S, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && is_cache_type(k_cache.scalar_type()) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
              "k_cache, v_cache must be contiguous float32, float16 or bfloat16 [blocks, block_size, Hkv, D] "
              "of one dtype");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [S, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt, "context_lens must be int32 [S]");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0, "head_dim must match and be a multiple of 8");
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == S && context_lens.size(0) == S, "one block table row and length per sequence");
  const at::Tensor lens_tensor = context_lens.contiguous();   // kept alive: lens points into it
  const int32_t* lens = lens_tensor.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "context length out of range for sequence ", s);
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "block id out of range for sequence ", s);
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_SWITCH(k_cache.scalar_type(), "paged_decode_attention", PAGEDSERVE_CACHE_TYPE_CASES([&] {
    const DecodeArgs<scalar_t> args{q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                    tables, lens, out.data_ptr<float>(), H, Hkv, D, block_size, max_blocks,
                                    static_cast<float>(scale)};
    at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        if (D == 64) decode_head<8>(args, item / H, item % H, scores);
        else if (D == 128) decode_head<16>(args, item / H, item % H, scores);
        else decode_head<0>(args, item / H, item % H, scores);
      }
    });
  }));
  return out;
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

// KV write (reshape_and_cache): rows t of key / value [T, Hkv, D] (rows may be strided, each row's Hkv * D floats
// contiguous) copied to slot slot_mapping[t] of k_cache / v_cache [blocks, block_size, Hkv, D] (rounded to the
// cache's type); slots < 0 (padding) skipped. One call per layer instead of a mask, a check and two index_copy_ calls.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat, "key, value must be float32 [T, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && is_cache_type(k_cache.scalar_type()) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
              "k_cache, v_cache must be contiguous float32, float16 or bfloat16 [blocks, block_size, kv_heads, "
              "head_dim] of one dtype");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row && k_cache.size(2) == key.size(1),
              "cache rows must hold kv_heads x head_dim of key");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || row % 8 == 0,
              "a float16 / bfloat16 cache needs kv_heads x head_dim a multiple of 8");
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "key / value rows must be contiguous within a row");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() == T && slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int64 [T]");
  const at::Tensor slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " out of range [0, ", num_slots, ")");
  const float *kp = key.data_ptr<float>(), *vp = value.data_ptr<float>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  AT_DISPATCH_SWITCH(k_cache.scalar_type(), "reshape_and_cache", PAGEDSERVE_CACHE_TYPE_CASES([&] {
    scalar_t *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      if (slots[t] < 0) continue;
      store_row(kp + t * ks, row, kc + slots[t] * row);
      store_row(vp + t * vs, row, vc + slots[t] * row);
    }
  }));
}

// ---- Elementwise layers (float32): the model's RMSNorm (+ residual add), rotary embedding and SwiGLU, each one pass
// over its rows instead of the reference's chain of small torch ops (pagedserve/ops.py holds the reference
// semantics these must match). Rows are split over the intra-op threads only when a step has enough of them to pay
// for waking a thread.

// Threads for `rows` rows of `width` floats each: one unless the step moves at least ~64K floats.
inline int64_t row_grain(int64_t rows, int64_t width) {
  return rows * width >= 65536 ? std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)) : rows;
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(1) == 1,
              what, " must be a float32 CPU tensor [T, width] with unit stride along width");
}

// (normed, h) with h = x + residual and normed = weight * h / sqrt(mean(h^2) + eps). Without a residual h is x, and
// the second output is an empty [0] tensor (outputs never alias inputs; the Python wrapper returns x instead).
// x, residual [T, N] rows may be strided; weight [N] contiguous.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const c10::optional<at::Tensor>& residual) {
  check_rows(x, "x");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(N % 8 == 0, "hidden size must be a multiple of 8, got ", N);
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == N && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be contiguous float32 [", N, "]");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape");
  }
  at::Tensor normed = at::empty({T, N}, x.options());
  at::Tensor h = at::empty({residual ? T : 0, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* hp = residual ? h.data_ptr<float>() : const_cast<float*>(xp);   // without a residual: read x, write nothing
  float* np_ = normed.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0, hs = residual ? N : xs;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, row_grain(T, N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * xs;
      float* hr = hp + t * hs;
      __m256 ss = _mm256_setzero_ps();
      for (int64_t k = 0; k < N; k += 8) {
        __m256 v = _mm256_loadu_ps(xr + k);
        if (rp) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(rp + t * rs + k));
          _mm256_storeu_ps(hr + k, v);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
      }
      const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum(ss) / static_cast<float>(N) + e));
      float* out = np_ + t * N;
      for (int64_t k = 0; k < N; k += 8)
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(wp + k),
                                                _mm256_mul_ps(_mm256_loadu_ps(hr + k), inv)));
    }
  });
  return {normed, h};
}

// Rotary embedding (ops.rotary_embedding): x [T, heads, D] with unit stride along D (rows and heads may be
// strided, e.g. views into a fused QKV output); cos_sin [max_position, D] (cos | sin halves); positions int64 [T].
// Returns a new contiguous [T, heads, D].
at::Tensor rotary_embedding(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos_sin,
                            bool is_neox) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(2) == 1,
              "x must be a float32 CPU tensor [T, heads, head_dim] with unit stride along head_dim");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16, got ", D);
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == D && cos_sin.scalar_type() == at::kFloat &&
                  cos_sin.is_contiguous(), "cos_sin must be contiguous float32 [max_position, head_dim]");
  TORCH_CHECK(positions.dim() == 1 && positions.numel() == T && positions.scalar_type() == at::kLong,
              "positions must be int64 [T]");
  const at::Tensor pos_c = positions.contiguous();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " out of range [0, ", max_pos, ")");
  at::Tensor out = at::empty({T, H, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cs = cos_sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T, row_grain(T, H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pos[t] * D;   // cos[0:half], sin[half:D]
      for (int64_t hd = 0; hd < H; ++hd) {
        const float* xr = xp + t * s0 + hd * s1;
        float* o = op + (t * H + hd) * D;
        if (is_neox) {        // (x1, x2) = halves: (x1 cos - x2 sin, x2 cos + x1 sin)
          for (int64_t i = 0; i < half; i += 8) {
            const __m256 x1 = _mm256_loadu_ps(xr + i), x2 = _mm256_loadu_ps(xr + half + i);
            const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(c + half + i);
            _mm256_storeu_ps(o + i, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
            _mm256_storeu_ps(o + half + i, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
          }
        } else {              // interleaved pairs (x[2i], x[2i+1]) rotated by frequency i
          for (int64_t i = 0; i < half; ++i) {
            const float a = xr[2 * i], b = xr[2 * i + 1], cv = c[i], sv = c[half + i];
            o[2 * i] = a * cv - b * sv;
            o[2 * i + 1] = b * cv + a * sv;
          }
        }
      }
    }
  });
  return out;
}

// SwiGLU (ops.silu_and_mul): x [T, 2d] (gate | up), rows may be strided; returns silu(gate) * up, [T, d].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t T = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 16 == 0, "x's width must be a multiple of 16, got ", x.size(1));
  at::Tensor out = at::empty({T, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const __m256 one = _mm256_set1_ps(1.0f);
  at::parallel_for(0, T, row_grain(T, 2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * xs;
      float* o = op + t * d;
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(g + d + i)));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_q4(Tensor x, Tensor codes, Tensor scale, Tensor min, int group_size, Tensor? bias) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor codes, Tensor scale, int group_size, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("rotary_embedding(Tensor positions, Tensor x, Tensor cos_sin, bool is_neox) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_q4", &linear_q4);
  m.impl("linear_q8", &linear_q8);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
