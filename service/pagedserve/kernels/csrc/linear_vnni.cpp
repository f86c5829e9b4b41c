// linear_q4_vnni: the int4 linears at decode (a few tokens) with int8 activations and AVX-512 VNNI integer dot
// products, on weights repacked once at load into 16-row panels (pack_q4_vnni). linear_q4_a8's function (the
// activations quantized per token in blocks of 32, one or two levels, linear_a8.hpp; the q4 min term from the
// activations' block sums), with the rows in the 16 int32 lanes of a zmm register, so one VPDPBUSD does 4 weights x
// 16 rows against 4 activation bytes broadcast, and a block's float work (convert, scale, min term) is 3 instructions
// for 16 rows. The fused float path (linear_quant.cpp, linear_fused512.hpp) decodes every weight to float32 and
// spends about 9 instructions per 32 weights per token; this one about 30 per 512 weights.
//
// Packed format, per panel p of rows 16p..16p+15 (rows past N have zero codes, scale and min):
//   packed uint8 [P, K / 32 * 256]: block b (32 weights along k), quarter j (8 weights), row r, byte q (0..3): low
//          nibble = code of (row, k = 32b + 8j + q), high nibble = code of (row, k = 32b + 8j + 4 + q); one quarter of
//          the panel is one 64-byte vector whose low nibbles are a 4-byte step for each of the 16 rows, and high
//          nibbles the next step;
//   dw, mw float32 [P, K / 32 * 16]: scale and min of block b for the 16 rows (a group of 64 or 128 repeats).
// Runtime-dispatched: the build targets AVX2 and the functions below are compiled for AVX-512 VNNI (target attributes),
// used only where the CPU reports AVX-512F/BW/VL/VNNI (linear_vnni_available).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "linear.hpp"
#include "linear_a8.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kVnniRows = 16;                     // rows per panel: one per int32 lane
constexpr int64_t kVnniBlockBytes = kVnniRows * 16;   // a block of 32 weights x 16 rows, two codes a byte
constexpr int64_t kVnniQ8BlockBytes = kVnniRows * 32; // int8 panels: a byte a code
constexpr int kVnniTokens = 4;                        // tokens per register tile
constexpr int64_t kVnniTokenBlock = 128;              // tokens per pass over the panels (their activations in L2)

#define PAGEDSERVE_VNNI512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc[j][t] (lane r: row r of panel j) += J panels' dot products with T tokens' activations, every block, L levels:
// each activation broadcast serves J panels. Per block and element the order is the levels' combined integer sum,
// then the min term (linear_a8.hpp's tile's order). a[l]: level l's int8 row of token 0 (tokens K apart); d: the block
// scales, s the block sums (tokens nb apart); codes/dw/mw: panel j's at codes[j], dw[j], mw[j].
// kQ8: int8 panels (pack_q8_vnni: codes + 128 as unsigned bytes, 8 quarters of 4 weights a block, no min): the
// biased products are corrected in int32 by c[t * nb + b] = 128 * the block's sum of quantized activations, so the
// sums are exactly linear_q8_a8's.
template <bool kQ8, int J, int T, int L>
PAGEDSERVE_VNNI512 __attribute__((noinline)) void panel_tile(const uint8_t* const* codes, const float* const* dw,
                                                             const float* const* mw, int64_t nb,
                                                             const int8_t* const* a, int64_t K, const float* d,
                                                             const float* s, const int32_t* c,
                                                             __m512 acc[J][T]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[J][L][T];
    for (int j = 0; j < J; ++j)
      for (int l = 0; l < L; ++l)
        for (int t = 0; t < T; ++t) isum[j][l][t] = _mm512_setzero_si512();
    if constexpr (kQ8) {
      for (int q = 0; q < 8; ++q) {
        __m512i w[J];
        for (int j = 0; j < J; ++j) w[j] = _mm512_loadu_si512(codes[j] + b * kVnniQ8BlockBytes + 64 * q);
        for (int l = 0; l < L; ++l)
          for (int t = 0; t < T; ++t) {
            const __m512i x = _mm512_set1_epi32(load_i32(a[l] + t * K + b * kActBlock + 4 * q));
            for (int j = 0; j < J; ++j) isum[j][l][t] = _mm512_dpbusd_epi32(isum[j][l][t], w[j], x);
          }
      }
    }
    for (int q = 0; q < (kQ8 ? 0 : 4); ++q) {
      __m512i lo[J], hi[J];
      for (int j = 0; j < J; ++j) {
        const __m512i v = _mm512_loadu_si512(codes[j] + b * kVnniBlockBytes + 64 * q);
        lo[j] = _mm512_and_si512(v, low4);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int l = 0; l < L; ++l)
        for (int t = 0; t < T; ++t) {
          const int8_t* ap = a[l] + t * K + b * kActBlock + 8 * q;
          const __m512i x0 = _mm512_set1_epi32(load_i32(ap)), x1 = _mm512_set1_epi32(load_i32(ap + 4));
          for (int j = 0; j < J; ++j) {
            isum[j][l][t] = _mm512_dpbusd_epi32(isum[j][l][t], lo[j], x0);
            isum[j][l][t] = _mm512_dpbusd_epi32(isum[j][l][t], hi[j], x1);
          }
        }
    }
    for (int j = 0; j < J; ++j) {
      const __m512 dwb = _mm512_loadu_ps(dw[j] + b * kVnniRows);
      for (int t = 0; t < T; ++t) {
        __m512i i32 = isum[j][0][t];
        if constexpr (L > 1)   // the two digits' sums: 255 * hi + lo (linear_a8.hpp's two_digits)
          i32 = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(i32, 8), i32), isum[j][L - 1][t]);
        if constexpr (kQ8) i32 = _mm512_sub_epi32(i32, _mm512_set1_epi32(c[t * nb + b]));
        acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(dwb, _mm512_set1_ps(d[t * nb + b])),
                                    acc[j][t]);
        if constexpr (!kQ8)
          acc[j][t] = _mm512_fmadd_ps(_mm512_loadu_ps(mw[j] + b * kVnniRows), _mm512_set1_ps(s[t * nb + b]), acc[j][t]);
      }
    }
  }
}

// Tokens m..m+T-1 through panels p..p+J-1 into out (+ bias).
template <bool kQ8, int J, int T>
PAGEDSERVE_VNNI512 void panel_tokens(const uint8_t* pk, const float* pdw, const float* pmw, int64_t nb,
                                     const ActsA8& q, int64_t m, int64_t K, float* out, int64_t N, int64_t p,
                                     const float* bias) {
  __m512 acc[J][T];
  const uint8_t* codes[J];
  const float *dw[J], *mw[J];
  for (int j = 0; j < J; ++j) {
    for (int t = 0; t < T; ++t) acc[j][t] = _mm512_setzero_ps();
    codes[j] = pk + (p + j) * nb * (kQ8 ? kVnniQ8BlockBytes : kVnniBlockBytes);
    dw[j] = pdw + (p + j) * nb * kVnniRows;
    mw[j] = kQ8 ? nullptr : pmw + (p + j) * nb * kVnniRows;
  }
  const int8_t* a[2] = {q.a[0].data() + m * K, q.levels > 1 ? q.a[1].data() + m * K : nullptr};
  const float* d = q.d.data() + m * nb;
  const float* s = q.s.data() + m * nb;
  const int32_t* c = kQ8 ? q.c.data() + m * nb : nullptr;
  if (q.levels > 1) panel_tile<kQ8, J, T, 2>(codes, dw, mw, nb, a, K, d, s, c, acc);
  else panel_tile<kQ8, J, T, 1>(codes, dw, mw, nb, a, K, d, s, c, acc);
  for (int j = 0; j < J; ++j) {
    const int64_t n0 = (p + j) * kVnniRows, rows = std::min(kVnniRows, N - n0);
    const __mmask16 mask = rows == kVnniRows ? 0xFFFF : static_cast<__mmask16>((1u << rows) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + (m + t) * N + n0, mask, _mm512_add_ps(acc[j][t], bv));
  }
}

// Tokens [m0, m1) through J panels from p: tiles of kVnniTokens, then the rest.
template <bool kQ8, int J>
PAGEDSERVE_VNNI512 void panel_range(const uint8_t* pk, const float* pdw, const float* pmw, int64_t nb,
                                    const ActsA8& q, int64_t m0, int64_t m1, int64_t K, float* out, int64_t N,
                                    int64_t p, const float* bias) {
  int64_t t = m0;
  for (; t + kVnniTokens <= m1; t += kVnniTokens)
    panel_tokens<kQ8, J, kVnniTokens>(pk, pdw, pmw, nb, q, t, K, out, N, p, bias);
  switch (m1 - t) {
    case 3: panel_tokens<kQ8, J, 3>(pk, pdw, pmw, nb, q, t, K, out, N, p, bias); break;
    case 2: panel_tokens<kQ8, J, 2>(pk, pdw, pmw, nb, q, t, K, out, N, p, bias); break;
    case 1: panel_tokens<kQ8, J, 1>(pk, pdw, pmw, nb, q, t, K, out, N, p, bias); break;
    default: break;
  }
}

// x [M, K] through P panels (two at a time: one activation broadcast serves both; an odd last panel alone).
template <bool kQ8>
void run_panels(const ActsA8& q, int64_t M, int64_t K, int64_t N, const uint8_t* pk, const float* pdw,
                const float* pmw, const float* b, float* o) {
  const int64_t nb = K / kActBlock, P = (N + kVnniRows - 1) / kVnniRows;
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kVnniTokenBlock) {   // a block's activations stay in L2 across the panels
      const int64_t m1 = std::min(M, m0 + kVnniTokenBlock);
      for (int64_t u = begin; u < end; ++u) {
        if (2 * u + 1 < P) panel_range<kQ8, 2>(pk, pdw, pmw, nb, q, m0, m1, K, o, N, 2 * u, b);
        else panel_range<kQ8, 1>(pk, pdw, pmw, nb, q, m0, m1, K, o, N, 2 * u, b);
      }
    }
  });
}

void check_x(const at::Tensor& x, int64_t levels, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(linear_vnni_available(), "the VNNI panels need a CPU with AVX-512 VNNI");
  TORCH_CHECK(levels == 1 || levels == 2, "levels must be 1 or 2, got ", levels);
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  check_input(x, x.size(1), bias, N);
  TORCH_CHECK(x.size(1) % kActBlock == 0, "K must be a multiple of 32, got ", x.size(1));
}

bool cpu_has_vnni512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

}  // namespace

bool linear_vnni_available() {
  static const bool available = cpu_has_vnni512();
  return available;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q4_vnni(const at::Tensor& codes, const at::Tensor& scale,
                                                            const at::Tensor& min, int64_t group_size) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K / 2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, nb = K / kActBlock, P = (N + kVnniRows - 1) / kVnniRows;
  TORCH_CHECK(K % kActBlock == 0, "K must be a multiple of 32, got ", K);
  check_groups(scale, N, K, group_size, "scale");
  check_groups(min, N, K, group_size, "min");
  at::Tensor packed = at::zeros({P, nb * kVnniBlockBytes}, codes.options());
  at::Tensor dw = at::zeros({P, nb * kVnniRows}, scale.options()), mw = at::zeros({P, nb * kVnniRows}, scale.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float *sc = scale.data_ptr<float>(), *mn = min.data_ptr<float>();
  uint8_t* pk = packed.data_ptr<uint8_t>();
  float *pdw = dw.data_ptr<float>(), *pmw = mw.data_ptr<float>();
  const int64_t groups = K / group_size;
  auto code = [&](int64_t n, int64_t k) -> uint8_t {   // GGUF order: byte i of a run holds weights i and i + 16
    const uint8_t byte = c[n * (K / 2) + k / 32 * 16 + k % 16];
    return (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
  };
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r = 0; r < kVnniRows && p * kVnniRows + r < N; ++r) {
        const int64_t n = p * kVnniRows + r;
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* blk = pk + p * nb * kVnniBlockBytes + b * kVnniBlockBytes;
          for (int j = 0; j < 4; ++j)
            for (int q = 0; q < 4; ++q) {
              const int64_t k = b * kActBlock + 8 * j + q;
              blk[64 * j + 4 * r + q] = static_cast<uint8_t>(code(n, k) | (code(n, k + 4) << 4));
            }
          pdw[(p * nb + b) * kVnniRows + r] = sc[n * groups + b * kActBlock / group_size];
          pmw[(p * nb + b) * kVnniRows + r] = mn[n * groups + b * kActBlock / group_size];
        }
      }
  });
  return {packed, dw, mw};
}

at::Tensor linear_q4_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dw, const at::Tensor& mw,
                          int64_t N, const c10::optional<at::Tensor>& bias, int64_t levels) {
  check_x(x, levels, bias, N);
  const int64_t K = x.size(1), M = x.size(0), nb = K / kActBlock, P = (N + kVnniRows - 1) / kVnniRows;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == P && packed.size(1) == nb * kVnniBlockBytes,
              "packed must be contiguous uint8 [ceil(N / 16), K / 32 * 256] (pack_q4_vnni)");
  for (const at::Tensor* t : {&dw, &mw})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == P &&
                    t->size(1) == nb * kVnniRows,
                "dw, mw must be contiguous float32 [ceil(N / 16), K / 32 * 16] (pack_q4_vnni)");
  at::Tensor out = at::empty({M, N}, x.options());
  const ActsA8 q = quantize_acts(x.data_ptr<float>(), M, K, static_cast<int>(levels));
  run_panels<false>(q, M, K, N, packed.data_ptr<uint8_t>(), dw.data_ptr<float>(), mw.data_ptr<float>(),
                    bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out;
}

std::tuple<at::Tensor, at::Tensor> pack_q8_vnni(const at::Tensor& codes, const at::Tensor& scale, int64_t group_size) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), nb = K / kActBlock, P = (N + kVnniRows - 1) / kVnniRows;
  TORCH_CHECK(K % kActBlock == 0, "K must be a multiple of 32, got ", K);
  check_groups(scale, N, K, group_size, "scale");
  at::Tensor packed = at::zeros({P, nb * kVnniQ8BlockBytes}, at::TensorOptions().dtype(at::kByte));
  at::Tensor dw = at::zeros({P, nb * kVnniRows}, scale.options());
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  uint8_t* pk = packed.data_ptr<uint8_t>();
  float* pdw = dw.data_ptr<float>();
  const int64_t groups = K / group_size;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r = 0; r < kVnniRows; ++r) {
        const int64_t n = p * kVnniRows + r;
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* blk = pk + p * nb * kVnniQ8BlockBytes + b * kVnniQ8BlockBytes;
          for (int j = 0; j < 8; ++j)
            for (int q = 0; q < 4; ++q)   // rows past N: code -128, scale 0 (their lanes are not stored)
              blk[64 * j + 4 * r + q] = static_cast<uint8_t>((n < N ? c[n * K + b * kActBlock + 4 * j + q] : 0) + 128);
          if (n < N) pdw[(p * nb + b) * kVnniRows + r] = sc[n * groups + b * kActBlock / group_size];
        }
      }
  });
  return {packed, dw};
}

at::Tensor linear_q8_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dw, int64_t N,
                          const c10::optional<at::Tensor>& bias, int64_t levels) {
  check_x(x, levels, bias, N);
  const int64_t K = x.size(1), M = x.size(0), nb = K / kActBlock, P = (N + kVnniRows - 1) / kVnniRows;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == P && packed.size(1) == nb * kVnniQ8BlockBytes,
              "packed must be contiguous uint8 [ceil(N / 16), K / 32 * 512] (pack_q8_vnni)");
  TORCH_CHECK(dw.scalar_type() == at::kFloat && dw.is_contiguous() && dw.dim() == 2 && dw.size(0) == P &&
                  dw.size(1) == nb * kVnniRows,
              "dw must be contiguous float32 [ceil(N / 16), K / 32 * 16] (pack_q8_vnni)");
  at::Tensor out = at::empty({M, N}, x.options());
  // with the blocks' integer sums (q.c) for the code bias
  const ActsA8 q = quantize_acts(x.data_ptr<float>(), M, K, static_cast<int>(levels), false, true);
  run_panels<true>(q, M, K, N, packed.data_ptr<uint8_t>(), dw.data_ptr<float>(), nullptr,
                   bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out;
}

#undef PAGEDSERVE_VNNI512

}  // namespace pagedserve::cpu
