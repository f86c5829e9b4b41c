// Integer pieces of the int8-activation linears (linear_a8.cpp): activations quantized per token in blocks of 32,
// weight rows repacked into 8-row panels, and the register tiles of 8 rows x T tokens that multiply them with
// integer dot products (AVX2: _mm256_maddubs_epi16 / _mm256_madd_epi16), as ggml-cpu's q4_1 x q8_1 and
// q8_0 x q8_0 dot products do, but with the rows in the vector lanes so one block's float work serves 8 rows.
//
// Activations (per token t, block b of 32 along K), one level: d[t, b] = max|x| / 127, a = round(x / d) in -127..127
// (int8), s[t, b] = d * sum(a) (ggml's q8_1 sum), x^ = a * d. Two levels: a 16-bit quantization written as two int8
// digits in base 255: d[t, b] = max|x| / 32512, Q = round(x / d) in -32512..32512, Q = 255 * hi + lo with hi =
// round(Q / 255) and lo in -127..127 (both symmetric int8, so the kernels' sign tricks hold), x^ = Q * d, s = d *
// sum(Q). The kernels take the two digits' integer dot products and combine them exactly, sum(w * Q) = 255 *
// sum(w * hi) + sum(w * lo) in int32, so a block costs one float step (the error of x^ is at most d / 2 = max|x| /
// 65024: a level-1 residual quantized again, d2 <= d / 254, gave the same bound with two float steps per block).
// The q4 min term takes s rather than the exact float sum of x so that
// the result is exactly the dot product of the weights with the rounded activations x^: the error is then sum_k
// w_k (x_k - x^_k), at most sum_b d[t, b] / 2 * sum_(k in b) |w_k|. (With the exact sum the error would be sum_k (w_k -
// min) (x_k - x^_k), the unsigned codes' offset added: measured about 2x larger, max error 0.72 against 0.34 for a
// random 97 x 256 Q4 weight and 37 tokens.) Weights, per panel of 8 rows n0..n0+7 (rows past N are zero):
//   codes: [K / 4][8 rows][4] bytes: step j (4 consecutive k) of the 8 rows is one 32-byte vector; q4 codes as
//          unsigned 0..15, q8 codes as signed int8;
//   dw, mw: [K / 32][8] float: the rows' scale and (q4) min of each block of 32 (a group of 64 or 128 repeats).
// One tile (8 rows x T tokens, block b): the 8 steps' u8 x s8 products summed in int32 lanes (row r's lane) per
// level, the levels combined (two_digits), then y[t, r] += float(isum) * (dw[b, r] * d[t, b]) (+ mw[b, r] * s[t, b]
// for q4).
#pragma once

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "cpu_types.hpp"

namespace pagedserve::cpu {

constexpr int64_t kActBlock = 32;   // activation block along K (one scale and one sum per token per block)
constexpr int kPanelRows = 8;       // weight rows per panel: one per int32 / float lane

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 32 int32 (i[4], each |i| <= 127) -> a[32] int8, in order.
inline void store_i8(const __m256i i[4], int8_t* a) {
  // packs interleave the 128-bit lanes: 4-byte groups come out as 0 2 4 6 1 3 5 7 of the wanted order
  const __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), _mm256_permutevar8x32_epi32(q, order));
}

// max |x| over one block of 32 (v[4]).
inline float block_amax(const __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float am = _mm_cvtss_f32(m);
  return am;
}

// One level (header): one block of 32 (v[4]) -> a[32] int8 and its scale *d; returns sum(a) (exact).
inline float quantize_block_a8(const __m256 v[4], int8_t* a, float* d) {
  const float am = block_amax(v);
  *d = am / 127.0f;
  const __m256 inv = _mm256_set1_ps(am > 0.0f ? 127.0f / am : 0.0f);
  __m256i i[4];   // round to nearest even (the default MXCSR mode); |x| * 127 / amax <= 127 (+ rounding)
  for (int p = 0; p < 4; ++p) i[p] = _mm256_cvtps_epi32(_mm256_mul_ps(v[p], inv));
  const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  store_i8(i, a);
  return hsum(_mm256_cvtepi32_ps(isum));   // exact: |sum| <= 32 * 127
}

// Two levels (header): one block of 32 (v[4]) -> Q = 255 * hi + lo, hi[32] and lo[32] int8, its scale *d = max|x| /
// 32512; returns sum(Q) (exact).
inline float quantize_block_q16(const __m256 v[4], int8_t* hi, int8_t* lo, float* d) {
  const float am = block_amax(v);
  *d = am / 32512.0f;
  const __m256 inv = _mm256_set1_ps(am > 0.0f ? 32512.0f / am : 0.0f), base = _mm256_set1_ps(255.0f);
  const __m256 inv_base = _mm256_set1_ps(1.0f / 255.0f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i h[4], l[4];
  __m256 qsum = _mm256_setzero_ps();
  for (int p = 0; p < 4; ++p) {
    // |Q| <= 32512 (+ rounding): Q / 255 is never within 0.001 of a half, so hi = round(Q / 255) through the float
    // reciprocal is exact and lo = Q - 255 * hi (exact in float) is in -127..127
    const __m256 q = _mm256_round_ps(_mm256_mul_ps(v[p], inv), kNearest);
    const __m256 hq = _mm256_round_ps(_mm256_mul_ps(q, inv_base), kNearest);
    h[p] = _mm256_cvtps_epi32(hq);
    l[p] = _mm256_cvtps_epi32(_mm256_fnmadd_ps(hq, base, q));
    qsum = _mm256_add_ps(qsum, q);   // exact: |partial sums| <= 32 * 32512 < 2^24
  }
  store_i8(h, hi);
  store_i8(l, lo);
  return hsum(qsum);
}

// x[K] -> per level l < levels: a[l][K] int8; d[K / 32]; s[K / 32] = d * sum of the block's quantized values.
// c (optional) = 128 * that sum, as int32. One level: quantize_block_a8; two: quantize_block_q16 (a[0] the high
// digit, a[1] the low). K a multiple of 32.
inline void quantize_row_a8(const float* x, int64_t K, int levels, int8_t* const* a, float* d, float* s,
                            int32_t* c = nullptr) {
  for (int64_t b = 0; b < K / kActBlock; ++b) {
    __m256 v[4];
    for (int p = 0; p < 4; ++p) v[p] = _mm256_loadu_ps(x + b * kActBlock + 8 * p);
    const float sum = levels > 1 ? quantize_block_q16(v, a[0] + b * kActBlock, a[1] + b * kActBlock, d + b)
                                 : quantize_block_a8(v, a[0] + b * kActBlock, d + b);
    s[b] = d[b] * sum;
    if (c) c[b] = 128 * static_cast<int32_t>(sum);
  }
}

// Two levels' int32 sums (hi, lo digits) -> the 16-bit activations' sum 255 * hi + lo, exact (|sum| <= 32 * 128 *
// 32512 < 2^31).
inline __m256i two_digits(__m256i hi, __m256i lo) {
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo);
}

// In place: r[i] lane j <-> r[j] lane i (8 x 8 32-bit elements).
inline void transpose8x8(__m256i r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = _mm256_castsi256_ps(r[2 * i]), b = _mm256_castsi256_ps(r[2 * i + 1]);
    t[2 * i] = _mm256_unpacklo_ps(a, b);
    t[2 * i + 1] = _mm256_unpackhi_ps(a, b);
  }
  for (int h = 0; h < 2; ++h) {   // rows 0-3 (h = 0) and 4-7
    const __m256* th = t + 4 * h;
    u[4 * h + 0] = _mm256_shuffle_ps(th[0], th[2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(th[0], th[2], 0xEE);
    u[4 * h + 2] = _mm256_shuffle_ps(th[1], th[3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(th[1], th[3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
    r[4 + i] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
  }
}

// One tile: 8 panel rows x T tokens over nb blocks, L levels of the activations. a[l]: level l's int8 row of token 0
// (tokens lda apart); d, s: token 0's block scales and sums (ldd apart). Adds into acc[t] (lane r: row r), per
// block in this order: the levels' combined product, then (q4) the min term: the order of linear_vnni.cpp's panels,
// so the two kernels give the same bits (the integer sums are exact in both).
template <bool kQ4, int T, int L>
inline void a8_tile(const uint8_t* codes, const float* dw, const float* mw, int64_t nb, const int8_t* const* a,
                    int64_t lda, const float* d, const float* s, int64_t ldd, __m256 acc[T]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = codes + b * (kActBlock * kPanelRows);
    __m256i isum[L][T];
    for (int l = 0; l < L; ++l)
      for (int t = 0; t < T; ++t) isum[l][t] = _mm256_setzero_si256();
    for (int j = 0; j < kActBlock / 4; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
      if constexpr (kQ4) {
        // u4 x s8 pairs are at most 2 * 15 * 127 = 3810 in magnitude: 8 steps summed in int16 stay below 32767
        for (int l = 0; l < L; ++l)
          for (int t = 0; t < T; ++t)
            isum[l][t] = _mm256_add_epi16(isum[l][t],
                                          _mm256_maddubs_epi16(w, bcast4(a[l] + t * lda + b * kActBlock + 4 * j)));
      } else {
        // signed x signed through u8 x s8: |w| against x carrying w's sign (pairs at most 2 * 128 * 127)
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int l = 0; l < L; ++l)
          for (int t = 0; t < T; ++t) {
            const __m256i p =
                _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(a[l] + t * lda + b * kActBlock + 4 * j), w));
            isum[l][t] = _mm256_add_epi32(isum[l][t], _mm256_madd_epi16(p, ones));
          }
      }
    }
    const __m256 dwb = _mm256_loadu_ps(dw + b * kPanelRows);
    for (int t = 0; t < T; ++t) {
      __m256i i32 = kQ4 ? _mm256_madd_epi16(isum[0][t], ones) : isum[0][t];
      if constexpr (L > 1) i32 = two_digits(i32, kQ4 ? _mm256_madd_epi16(isum[L - 1][t], ones) : isum[L - 1][t]);
      const __m256 scale = _mm256_mul_ps(dwb, _mm256_broadcast_ss(d + t * ldd + b));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), scale, acc[t]);
      if constexpr (kQ4)
        acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(mw + b * kPanelRows), _mm256_broadcast_ss(s + t * ldd + b), acc[t]);
    }
  }
}

// A block of tokens' activations in int8, one or two levels (quantize_row_a8 per token).
struct ActsA8 {
  int levels;
  bool vnni;                  // linear_a8.cpp: take the AVX-VNNI tile (linear_a8_vnni.hpp)
  std::vector<int8_t> a[2];   // per level [M, K] (two levels: the high and the low digit)
  std::vector<float> d;       // [M, K / 32]
  std::vector<float> s;       // [M, K / 32]
  std::vector<int32_t> c;     // with sums (linear_q8_vnni): [M, K / 32], 128 * each block's sum of quantized values
};

inline ActsA8 quantize_acts(const float* x, int64_t M, int64_t K, int levels, bool vnni = false, bool sums = false) {
  const int64_t nb = K / kActBlock;
  ActsA8 q{levels, vnni, {}, std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int l = 0; l < levels; ++l) q.a[l].resize(M * K);
  if (sums) q.c.resize(M * nb);
  // tokens over ATen's threads (a long chunk's quantization is not serial work; inside a parallel region, as in
  // linear_a8.cpp, it runs on the calling thread); each row's result is the same either way
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int8_t* a[2] = {q.a[0].data() + t * K, levels > 1 ? q.a[1].data() + t * K : nullptr};
      quantize_row_a8(x + t * K, K, levels, a, q.d.data() + t * nb, q.s.data() + t * nb,
                      sums ? q.c.data() + t * nb : nullptr);
    }
  });
  return q;
}

}  // namespace pagedserve::cpu
