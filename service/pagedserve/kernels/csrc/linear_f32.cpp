// The float32-weight linear (linear_f32): a register tile of rows x tokens reading the weights in place for a few
// tokens, transposed panels for more (formats and paths: linear.hpp).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "linear.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kRows = 3;          // output rows per register tile of the few-token float32 path (run)

// The weight's row n, read in place (the quantized decoders in linear_quant.cpp share this interface).
struct F32Rows {
  const float* w;
  int64_t K;
  const float* row(int64_t n, float*) const { return w + n * K; }
};

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

}  // namespace

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

}  // namespace pagedserve::cpu
