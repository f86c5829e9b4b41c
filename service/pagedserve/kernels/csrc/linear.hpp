// Pieces shared by the weight-streaming linears: linear_f32.cpp (float32 weights) and linear_quant.cpp (4-bit and
// 8-bit weights).
//
// Linears: y[M, N] = x[M, K] . W[N, K]^T (+ bias), float32
// activations and accumulation, W stored as float32, as 4-bit codes with a scale and a min per group, or as int8
// codes with a scale per group.
//
// Why: at decode (M = 1..64 tokens) a linear is bound by how fast its weights stream from memory; torch's fp32 GEMM
// reaches about a third of this machine's read bandwidth there, and its int4/int8 CPU kernels are vectorized only for
// bfloat16 activations on AVX2. One path for every token count M (so a row's result never depends on M: batch
// invariance): quantized weights decoded 4 rows at a time into a row buffer in L1, float32 weights read in place,
// then register tiles of rows x tokens with k in vector lanes and one horizontal sum per output (rows_times_tokens).
//
// Formats (row-major, one row per output channel n):
//   f32: W float32 [N, K].
//   q4:  codes uint8 [N, K / 2]: each run of 32 weights is 16 bytes, byte j holding weight j in its low nibble and
//        weight j + 16 in its high nibble (GGUF Q4_0/Q4_1's order); w = q * scale[n, g] + min[n, g], q in 0..15,
//        g = k / group_size; scale, min float32 [N, K / group_size].
//   q8:  codes int8 [N, K]; w = q * scale[n, g], scale float32 [N, K / group_size].
// Threads: ATen's intra-op pool (at::parallel_for) over tiles of output rows, so the kernels share torch's threads.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "cpu_types.hpp"

namespace pagedserve::cpu {

constexpr int64_t kTokenBlock = 96;   // tokens per block: a long prefill chunk's activations stay in L2

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

inline void check_input(const at::Tensor& x, int64_t K, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [M, K]");
  TORCH_CHECK(x.size(1) == K, "x has K=", x.size(1), ", the weight K=", K);
  TORCH_CHECK(K % 8 == 0, "K must be a multiple of 8, got ", K);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float32 tensor [N]");
  }
}

// A q4 / q8 weight's per-group tensor (scale or min): float32 [N, K / group_size], group_size a positive multiple of
// 32 dividing K.
inline void check_groups(const at::Tensor& t, int64_t N, int64_t K, int64_t group_size, const char* what) {
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
              "group_size must be a positive multiple of 32 dividing K, got ", group_size);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == N &&
                  t.size(1) == K / group_size,
              what, " must be contiguous float32 [N, K / group_size]");
}

}  // namespace pagedserve::cpu
