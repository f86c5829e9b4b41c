// Elementwise layers (float32): the model's RMSNorm (+ residual add), rotary embedding and SwiGLU, each one pass
// over its rows instead of the reference's chain of small torch ops (pagedserve/ops.py holds the reference
// semantics these must match). Rows are split over the intra-op threads only when a step has enough of them to pay
// for waking a thread.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "cpu_types.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

// Threads for `rows` rows of `width` floats each: one unless the step moves at least ~64K floats.
inline int64_t row_grain(int64_t rows, int64_t width) {
  return rows * width >= 65536 ? std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)) : rows;
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(1) == 1,
              what, " must be a float32 CPU tensor [T, width] with unit stride along width");
}

}  // namespace

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

}  // namespace pagedserve::cpu
