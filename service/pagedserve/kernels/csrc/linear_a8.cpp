// linear_q4_a8, linear_q8_a8: the quantized linears with int8 activations, one level or two (the second quantizes the
// first's residual: twice the integer work, 254x smaller rounding error) (formats: linear.hpp; the integer tiles and
// the activation format: linear_a8.hpp). The float path (linear_quant.cpp) does one float FMA per weight per token
// after decoding each weight to float32; these quantize the activations once per call and do 4 weights x 1 token per
// byte lane with maddubs, so the float work is one FMA (two for q4) per block of 32 per 8 rows per token.
//
// Work split: 8-row panels over ATen's threads, in one parallel region; per block of kA8TokenBlock tokens each thread
// quantizes the block's activations, then per panel the panel's codes are repacked (unpacked nibbles, 8 x 8 transposes
// of 4-byte steps) into a buffer in L1, then every token of the block runs through it in tiles of 8 rows x kA8Tokens
// tokens. pack_a8_panels packs every panel once (at load) and linear_a8_packed runs the same loop on them: the same
// bits without the per-call repack, which costs as much as the tiles at a few tokens (a 49152 x 576 LM head at one
// token: 1.43 ms per call repacking, 0.48 ms packed; 2 threads, AMD EPYC without AMX).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "linear.hpp"
#include "linear_a8.hpp"
#include "linear_a8_vnni.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int kA8Tokens = 4;            // tokens per register tile (4 int and 4 float accumulators)
constexpr int64_t kA8TokenBlock = 256;  // tokens per panel repack: a block's int8 activations stay in L2

// One panel (rows n0..n0+rows-1 of the weight) into codes [K / 4][8][4], dw and mw [K / 32][8].
struct Q4Panels {
  const uint8_t* codes;
  const float* scale;
  const float* min;
  int64_t K, group_size;

  void view(int64_t, int64_t n0, int64_t rows, uint8_t* buf, float* dwb, float* mwb, const uint8_t** c,
            const float** dw, const float** mw) const {
    pack(n0, rows, buf, dwb, mwb);
    *c = buf, *dw = dwb, *mw = mwb;
  }
  void pack(int64_t n0, int64_t rows, uint8_t* out, float* dw, float* mw) const {
    const int64_t nb = K / kActBlock, groups = K / group_size;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      __m256i r[kPanelRows];
      for (int i = 0; i < kPanelRows; ++i) {
        if (i >= rows) { r[i] = _mm256_setzero_si256(); continue; }
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (n0 + i) * (K / 2) + b * 16));
        r[i] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
      }
      transpose8x8(r);
      for (int j = 0; j < kPanelRows; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 256 + 32 * j), r[j]);
      const int64_t g = b * kActBlock / group_size;
      for (int i = 0; i < kPanelRows; ++i) {
        dw[b * kPanelRows + i] = i < rows ? scale[(n0 + i) * groups + g] : 0.0f;
        mw[b * kPanelRows + i] = i < rows ? min[(n0 + i) * groups + g] : 0.0f;
      }
    }
  }
};

struct Q8Panels {
  const int8_t* codes;
  const float* scale;
  int64_t K, group_size;

  void view(int64_t, int64_t n0, int64_t rows, uint8_t* buf, float* dwb, float*, const uint8_t** c,
            const float** dw, const float** mw) const {
    pack(n0, rows, buf, dwb, nullptr);
    *c = buf, *dw = dwb, *mw = nullptr;
  }
  void pack(int64_t n0, int64_t rows, uint8_t* out, float* dw, float*) const {
    const int64_t nb = K / kActBlock, groups = K / group_size;
    for (int64_t b = 0; b < nb; ++b) {
      __m256i r[kPanelRows];
      for (int i = 0; i < kPanelRows; ++i)
        r[i] = i < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (n0 + i) * K + b * 32))
                        : _mm256_setzero_si256();
      transpose8x8(r);
      for (int j = 0; j < kPanelRows; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 256 + 32 * j), r[j]);
      const int64_t g = b * kActBlock / group_size;
      for (int i = 0; i < kPanelRows; ++i) dw[b * kPanelRows + i] = i < rows ? scale[(n0 + i) * groups + g] : 0.0f;
    }
  }
};

// Panels packed once (pack_a8_panels): panel u's codes at codes + u * K * 8, its dw (and mw) at u * K / 32 * 8.
struct PackedPanels {
  const uint8_t* codes;
  const float* dw;
  const float* mw;   // null for q8
  int64_t K;

  void view(int64_t unit, int64_t, int64_t, uint8_t*, float*, float*, const uint8_t** c, const float** dw_,
            const float** mw_) const {
    const int64_t nb = K / kActBlock;
    *c = codes + unit * K * kPanelRows, *dw_ = dw + unit * nb * kPanelRows;
    *mw_ = mw ? mw + unit * nb * kPanelRows : nullptr;
  }
};

// Tokens [0, T) of a token block through one packed panel, out[t * N + n0 + r] for r < rows.
template <bool kQ4, int T>
void panel_tokens(const uint8_t* codes, const float* dw, const float* mw, int64_t K, const ActsA8& q, int64_t m,
                  float* out, int64_t N, int64_t n0, int64_t rows, const float* bias) {
  const int64_t nb = K / kActBlock;
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const float* s = q.s.data() + m * nb;
  const int8_t* a[2] = {q.a[0].data() + m * K, q.levels > 1 ? q.a[1].data() + m * K : nullptr};
  const float* d = q.d.data() + m * nb;
  if (q.vnni) {
    if (q.levels > 1) a8_tile_vnni<kQ4, T, 2>(codes, dw, mw, nb, a, K, d, s, nb, acc);
    else a8_tile_vnni<kQ4, T, 1>(codes, dw, mw, nb, a, K, d, s, nb, acc);
  } else {
    if (q.levels > 1) a8_tile<kQ4, T, 2>(codes, dw, mw, nb, a, K, d, s, nb, acc);
    else a8_tile<kQ4, T, 1>(codes, dw, mw, nb, a, K, d, s, nb, acc);
  }
  __m256 b = _mm256_setzero_ps();
  alignas(32) float tmp[kPanelRows];
  if (bias) {
    for (int i = 0; i < kPanelRows; ++i) tmp[i] = i < rows ? bias[n0 + i] : 0.0f;
    b = _mm256_load_ps(tmp);
  }
  for (int t = 0; t < T; ++t) {
    float* o = out + (m + t) * N + n0;
    if (rows == kPanelRows) {
      _mm256_storeu_ps(o, _mm256_add_ps(acc[t], b));
    } else {
      _mm256_store_ps(tmp, _mm256_add_ps(acc[t], b));
      std::copy(tmp, tmp + rows, o);
    }
  }
}

template <bool kQ4, class Panels>
void run_panels_a8(const Panels& panels, const float* x, int64_t M, int64_t K, int64_t N, float* out,
                   const float* bias, int levels) {
  const int64_t units = (N + kPanelRows - 1) / kPanelRows, nb = K / kActBlock;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> codes(K * kPanelRows);
    std::vector<float> dw(nb * kPanelRows), mw(nb * kPanelRows);
    for (int64_t m0 = 0; m0 < M; m0 += kA8TokenBlock) {
      // every thread quantizes the block's tokens itself: no second parallel region (each costs a wake-up of
      // the other threads, long when the cores are shared), at about 1 / (N / 8) of the block's integer work
      const int64_t m1 = std::min(M, m0 + kA8TokenBlock) - m0;
      const ActsA8 q = quantize_acts(x + m0 * K, m1, K, levels, a8_vnni_enabled());
      float* ob = out + m0 * N;
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t n0 = unit * kPanelRows, rows = std::min<int64_t>(kPanelRows, N - n0);
        const uint8_t* pc;
        const float *pd, *pm;
        panels.view(unit, n0, rows, codes.data(), dw.data(), mw.data(), &pc, &pd, &pm);
        int64_t m = 0;
        for (; m + kA8Tokens <= m1; m += kA8Tokens)
          panel_tokens<kQ4, kA8Tokens>(pc, pd, pm, K, q, m, ob, N, n0, rows, bias);
        switch (m1 - m) {
          case 3: panel_tokens<kQ4, 3>(pc, pd, pm, K, q, m, ob, N, n0, rows, bias); break;
          case 2: panel_tokens<kQ4, 2>(pc, pd, pm, K, q, m, ob, N, n0, rows, bias); break;
          case 1: panel_tokens<kQ4, 1>(pc, pd, pm, K, q, m, ob, N, n0, rows, bias); break;
          default: break;
        }
      }
    }
  });
}

void check_levels(int64_t levels) {
  TORCH_CHECK(levels == 1 || levels == 2, "levels must be 1 or 2, got ", levels);
}

void check_a8_groups(const at::Tensor& t, int64_t N, int64_t K, int64_t group_size, const char* what) {
  TORCH_CHECK(K % kActBlock == 0, "K must be a multiple of 32 for int8 activations, got ", K);
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == N &&
                  t.size(1) == K / group_size,
              what, " must be contiguous float32 [N, K / group_size]");
}

}  // namespace

at::Tensor linear_q4_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                        int64_t group_size, const c10::optional<at::Tensor>& bias, int64_t levels) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K / 2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, M = x.size(0);
  check_input(x, K, bias, N);
  check_levels(levels);
  check_a8_groups(scale, N, K, group_size, "scale");
  check_a8_groups(min, N, K, group_size, "min");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  run_panels_a8<true>(Q4Panels{codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), min.data_ptr<float>(), K,
                               group_size},
                      x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                      static_cast<int>(levels));
  return out;
}

at::Tensor linear_q8_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t group_size,
                        const c10::optional<at::Tensor>& bias, int64_t levels) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), M = x.size(0);
  check_input(x, K, bias, N);
  check_levels(levels);
  check_a8_groups(scale, N, K, group_size, "scale");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  run_panels_a8<false>(Q8Panels{codes.data_ptr<int8_t>(), scale.data_ptr<float>(), K, group_size},
                       x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                       static_cast<int>(levels));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_a8_panels(const at::Tensor& codes, const at::Tensor& scale,
                                                              const c10::optional<at::Tensor>& min,
                                                              int64_t group_size) {
  const bool q4 = min.has_value();
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == (q4 ? at::kByte : at::kChar),
              q4 ? "codes must be contiguous uint8 [N, K / 2] (with min: int4)"
                 : "codes must be contiguous int8 [N, K] (without min: int8)");
  const int64_t N = codes.size(0), K = codes.size(1) * (q4 ? 2 : 1), nb = K / kActBlock;
  const int64_t units = (N + kPanelRows - 1) / kPanelRows;
  check_a8_groups(scale, N, K, group_size, "scale");
  if (q4) check_a8_groups(*min, N, K, group_size, "min");
  at::Tensor packed = at::empty({units, K * kPanelRows}, codes.options().dtype(at::kByte));
  at::Tensor dw = at::empty({units, nb * kPanelRows}, scale.options());
  at::Tensor mw = at::empty({q4 ? units : 0, nb * kPanelRows}, scale.options());
  const Q4Panels p4{q4 ? codes.data_ptr<uint8_t>() : nullptr, scale.data_ptr<float>(),
                    q4 ? min->data_ptr<float>() : nullptr, K, group_size};
  const Q8Panels p8{q4 ? nullptr : codes.data_ptr<int8_t>(), scale.data_ptr<float>(), K, group_size};
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n0 = u * kPanelRows, rows = std::min<int64_t>(kPanelRows, N - n0);
      uint8_t* c = packed.data_ptr<uint8_t>() + u * K * kPanelRows;
      float* d = dw.data_ptr<float>() + u * nb * kPanelRows;
      if (q4) p4.pack(n0, rows, c, d, mw.data_ptr<float>() + u * nb * kPanelRows);
      else p8.pack(n0, rows, c, d, nullptr);
    }
  });
  return {packed, dw, mw};
}

at::Tensor linear_a8_packed(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dw, const at::Tensor& mw,
                            int64_t N, const c10::optional<at::Tensor>& bias, int64_t levels) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t K = x.size(1), M = x.size(0), nb = K / kActBlock, units = (N + kPanelRows - 1) / kPanelRows;
  check_input(x, K, bias, N);
  check_levels(levels);
  TORCH_CHECK(K % kActBlock == 0, "K must be a multiple of 32 for int8 activations, got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == units && packed.size(1) == K * kPanelRows,
              "packed must be contiguous uint8 [ceil(N / 8), K * 8] (pack_a8_panels)");
  const bool q4 = mw.numel() > 0;
  for (const at::Tensor* t : q4 ? std::vector<const at::Tensor*>{&dw, &mw} : std::vector<const at::Tensor*>{&dw})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == units &&
                    t->size(1) == nb * kPanelRows,
                "dw, mw must be contiguous float32 [ceil(N / 8), K / 32 * 8] (pack_a8_panels)");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const PackedPanels panels{packed.data_ptr<uint8_t>(), dw.data_ptr<float>(), q4 ? mw.data_ptr<float>() : nullptr, K};
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (q4) run_panels_a8<true>(panels, x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), b, static_cast<int>(levels));
  else run_panels_a8<false>(panels, x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), b, static_cast<int>(levels));
  return out;
}

bool linear_a8_vnni(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "mode must be -1 (query), 0 (off) or 1 (on where the CPU has AVX-VNNI)");
  if (mode >= 0) a8_vnni_enabled() = mode == 1 && __builtin_cpu_supports("avxvnni");
  return a8_vnni_enabled();
}

}  // namespace pagedserve::cpu
