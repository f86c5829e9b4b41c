// The float32-weight linear (linear_f32): register tiles of rows x tokens reading the weights in place, for every
// token count (formats and paths: linear.hpp).
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

// Float32 weights: kRows rows at a time read in place, times every token (tokens in blocks of kTokenBlock).
void run(const F32Rows& rows, const float* x, int64_t M, int64_t K, int64_t N, float* out, const float* bias) {
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kTokenBlock) {   // a long chunk's activations stay in L2 across the tiles
      const int64_t mt = std::min(kTokenBlock, M - m0);
      const float* xb = x + m0 * K;
      float* ob = out + m0 * N;
      for (int64_t tile_idx = begin; tile_idx < end; ++tile_idx) {
        const int64_t n0 = tile_idx * kRows;
        const int64_t r = std::min(kRows, N - n0);
        const float* w[kRows];
        for (int64_t i = 0; i < r; ++i) w[i] = rows.row(n0 + i, nullptr);
        if (r == 3) rows_times_tokens<3>(w, xb, mt, K, ob, N, n0, bias);
        else if (r == 2) rows_times_tokens<2>(w, xb, mt, K, ob, N, n0, bias);
        else rows_times_tokens<1>(w, xb, mt, K, ob, N, n0, bias);
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
  run(rows, x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), b);
  return out;
}

}  // namespace pagedserve::cpu
