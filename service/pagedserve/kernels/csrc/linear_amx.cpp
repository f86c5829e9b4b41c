// linear_q4_amx: linear_q4_a8's function (the same int8 activations, one or two levels, linear_a8.hpp) on Intel AMX
// (Sapphire Rapids and later), for prefill chunks. One TDPBUSD multiplies a 16-row x 32-weight block of unsigned q4
// codes (tile A) by the block's int8 activations of 16 tokens (tile B, 8 rows of 4-byte steps x 16 tokens) into
// 16 x 16 int32 sums (tile C): 8,192 multiply-adds in one instruction, against 32 per vpdpbusd. The scales differ
// per block of 32 (weights: per row; activations: per token), so every block's sums are stored and added into
// float32 accumulators (16 rows x 16 tokens in 16 zmm registers) with the product of the two scales, plus the q4
// min term from the activations' block sums, as linear_a8.hpp's tile does: the integer sums are exact, so the
// result equals linear_q4_a8's up to float32 summation order.
//
// Availability: the CPU reports AMX-TILE and AMX-INT8 (CPUID leaf 7) and Linux grants the process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM, once); otherwise linear_amx_available() is false and the op raises. Only this
// file's kernel functions are compiled for AVX-512 and AMX (target attributes); the build stays -mavx2.
// Work split: 16-row panels over ATen's threads; per block of kAmxTokenBlock tokens each thread quantizes the
// activations and repacks them into B tiles, then per panel unpacks the codes into A tiles and runs every group of
// 16 tokens through them.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "linear.hpp"
#include "linear_a8.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int kAmxRows = 16;             // weight rows per panel: tile A's rows, tile C's rows
constexpr int kAmxTokens = 16;           // tokens per group: tile C's int32 columns
constexpr int64_t kAmxTokenBlock = 256;  // tokens quantized and repacked at a time
constexpr int64_t kTileBytes = 512;      // one block's A tile (16 x 32) or B tile (8 x 64)

struct alignas(64) TileConfig {   // the LDTILECFG memory format, palette 1
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;   // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The activations of tokens [t0, t0 + 16) (zeros past m1), level l, in B tiles: per block b, [8 steps][16 tokens][4].
void pack_b(const ActsA8& q, int l, int64_t t0, int64_t m1, int64_t K, int8_t* out) {
  const int64_t nb = K / kActBlock;
  std::fill(out, out + nb * kTileBytes, int8_t{0});
  for (int64_t t = 0; t < kAmxTokens && t0 + t < m1; ++t) {
    const int8_t* a = q.a[l].data() + (t0 + t) * K;
    for (int64_t b = 0; b < nb; ++b)
      for (int j = 0; j < 8; ++j) std::memcpy(out + b * kTileBytes + (j * kAmxTokens + t) * 4, a + b * 32 + 4 * j, 4);
  }
}

// Per block b of tokens [t0, t0 + 16): v[b][t] = src[(t0 + t) * nb + b] (zeros past m1).
void pack_scales(const float* src, int64_t t0, int64_t m1, int64_t nb, float* out) {
  std::fill(out, out + nb * kAmxTokens, 0.0f);
  for (int64_t t = 0; t < kAmxTokens && t0 + t < m1; ++t)
    for (int64_t b = 0; b < nb; ++b) out[b * kAmxTokens + t] = src[(t0 + t) * nb + b];
}

// Rows n0..n0+rows-1 into A tiles: per block b, [16 rows][32] unsigned codes; dw, mw [b][16] (zeros past rows).
void pack_a(const uint8_t* codes, const float* scale, const float* min, int64_t K, int64_t group_size, int64_t n0,
            int64_t rows, uint8_t* out, float* dw, float* mw) {
  const int64_t nb = K / kActBlock, groups = K / group_size;
  std::fill(out, out + nb * kTileBytes, uint8_t{0});
  std::fill(dw, dw + nb * kAmxRows, 0.0f);
  std::fill(mw, mw + nb * kAmxRows, 0.0f);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* c = codes + (n0 + i) * (K / 2);
    for (int64_t b = 0; b < nb; ++b) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 16));
      uint8_t* o = out + b * kTileBytes + i * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_and_si128(v, low4));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
      const int64_t g = (n0 + i) * groups + b * kActBlock / group_size;
      dw[b * kAmxRows + i] = scale[g];
      mw[b * kAmxRows + i] = min[g];
    }
  }
}

struct GroupTiles {   // one group of 16 tokens, ready for the tiles
  const int8_t* b[2];     // per level: nb B tiles
  const float* d[2];      // per level: [nb][16] token scales
  const float* s;         // [nb][16] block sums
};

// One panel x one token group: C = A . B per block and level, then acc[r][t] += C * dw[r] * d[t] (+ mw[r] * s[t]).
// Writes out[(t0 + t) * N + n0 + r] (+ bias) for t < tokens, r < rows.
__attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8"), noinline)) void amx_panel_group(
    const uint8_t* a, const float* dw, const float* mw, int64_t nb, int levels, const GroupTiles& g, float* out,
    int64_t N, int64_t n0, int64_t rows, int64_t tokens, const float* bias) {
  alignas(64) int32_t c[2][kAmxRows * kAmxTokens];
  __m512 acc[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    _tile_loadd(2, a + blk * kTileBytes, 32);
    _tile_zero(0);
    _tile_loadd(3, g.b[0] + blk * kTileBytes, 64);
    _tile_dpbusd(0, 2, 3);
    _tile_stored(0, c[0], 64);
    if (levels > 1) {
      _tile_zero(1);
      _tile_loadd(4, g.b[1] + blk * kTileBytes, 64);
      _tile_dpbusd(1, 2, 4);
      _tile_stored(1, c[1], 64);
    }
    const __m512 d0 = _mm512_loadu_ps(g.d[0] + blk * kAmxTokens), sv = _mm512_loadu_ps(g.s + blk * kAmxTokens);
    const float *dwb = dw + blk * kAmxRows, *mwb = mw + blk * kAmxRows;
    for (int r = 0; r < kAmxRows; ++r) {
      const __m512 w = _mm512_set1_ps(dwb[r]);
      const __m512 c0 = _mm512_cvtepi32_ps(_mm512_load_si512(c[0] + r * kAmxTokens));
      acc[r] = _mm512_fmadd_ps(c0, _mm512_mul_ps(w, d0), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mwb[r]), sv, acc[r]);
    }
    if (levels > 1) {
      const __m512 d1 = _mm512_loadu_ps(g.d[1] + blk * kAmxTokens);
      for (int r = 0; r < kAmxRows; ++r) {
        const __m512 c1 = _mm512_cvtepi32_ps(_mm512_load_si512(c[1] + r * kAmxTokens));
        acc[r] = _mm512_fmadd_ps(c1, _mm512_mul_ps(_mm512_set1_ps(dwb[r]), d1), acc[r]);
      }
    }
  }
  alignas(64) float tmp[kAmxRows][kAmxTokens];
  for (int r = 0; r < kAmxRows; ++r) _mm512_store_ps(tmp[r], acc[r]);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t r = 0; r < rows; ++r) out[t * N + n0 + r] = tmp[r][t] + (bias ? bias[n0 + r] : 0.0f);
}

__attribute__((target("amx-tile"))) void amx_tiles_on() {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = kAmxRows, cfg.colsb[t] = kAmxTokens * 4;   // C: 16 x 16 int32
  cfg.rows[2] = kAmxRows, cfg.colsb[2] = 32;                                      // A: 16 rows x 32 codes
  for (int t : {3, 4}) cfg.rows[t] = 8, cfg.colsb[t] = kAmxTokens * 4;            // B: 8 steps x 16 tokens x 4
  // the compiler does not see ldtilecfg read all 64 bytes: without this barrier it drops the stores above
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void amx_tiles_off() { _tile_release(); }

void run_q4_amx(const uint8_t* codes, const float* scale, const float* min, int64_t group_size, const float* x,
                int64_t M, int64_t K, int64_t N, float* out, const float* bias, int levels) {
  const int64_t panels = (N + kAmxRows - 1) / kAmxRows, nb = K / kActBlock;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    amx_tiles_on();
    std::vector<uint8_t> a(nb * kTileBytes);
    std::vector<float> dw(nb * kAmxRows), mw(nb * kAmxRows);
    for (int64_t m0 = 0; m0 < M; m0 += kAmxTokenBlock) {
      const int64_t m1 = std::min(M, m0 + kAmxTokenBlock) - m0, ngroups = (m1 + kAmxTokens - 1) / kAmxTokens;
      const ActsA8 q = quantize_acts(x + m0 * K, m1, K, levels);
      std::vector<int8_t> bt(levels * ngroups * nb * kTileBytes);
      std::vector<float> sc((levels + 1) * ngroups * nb * kAmxTokens);
      std::vector<GroupTiles> groups(ngroups);
      for (int64_t gi = 0; gi < ngroups; ++gi) {
        GroupTiles& g = groups[gi];
        float* base = sc.data() + gi * (levels + 1) * nb * kAmxTokens;
        for (int l = 0; l < levels; ++l) {
          int8_t* b = bt.data() + (gi * levels + l) * nb * kTileBytes;
          pack_b(q, l, gi * kAmxTokens, m1, K, b);
          pack_scales(q.d[l].data(), gi * kAmxTokens, m1, nb, base + l * nb * kAmxTokens);
          g.b[l] = b, g.d[l] = base + l * nb * kAmxTokens;
        }
        pack_scales(q.s.data(), gi * kAmxTokens, m1, nb, base + levels * nb * kAmxTokens);
        g.s = base + levels * nb * kAmxTokens;
      }
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kAmxRows, rows = std::min<int64_t>(kAmxRows, N - n0);
        pack_a(codes, scale, min, K, group_size, n0, rows, a.data(), dw.data(), mw.data());
        for (int64_t gi = 0; gi < ngroups; ++gi) {
          const int64_t t0 = gi * kAmxTokens, tokens = std::min<int64_t>(kAmxTokens, m1 - t0);
          amx_panel_group(a.data(), dw.data(), mw.data(), nb, levels, groups[gi], out + (m0 + t0) * N, N, n0, rows,
                          tokens, bias);
        }
      }
    }
    amx_tiles_off();
  });
}

}  // namespace

bool linear_amx_available() { return amx_supported(); }

at::Tensor linear_q4_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                         int64_t group_size, const c10::optional<at::Tensor>& bias, int64_t levels) {
  TORCH_CHECK(amx_supported(), "linear_q4_amx: this CPU (or the OS) does not provide AMX-INT8");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K / 2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, M = x.size(0);
  check_input(x, K, bias, N);
  TORCH_CHECK(levels == 1 || levels == 2, "levels must be 1 or 2, got ", levels);
  TORCH_CHECK(K % kActBlock == 0, "K must be a multiple of 32 for int8 activations, got ", K);
  check_groups(scale, N, K, group_size, "scale");
  check_groups(min, N, K, group_size, "min");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  run_q4_amx(codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), min.data_ptr<float>(), group_size,
             x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
             static_cast<int>(levels));
  return out;
}

}  // namespace pagedserve::cpu
