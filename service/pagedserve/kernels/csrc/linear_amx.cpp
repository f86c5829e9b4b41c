// linear_q4_amx: linear_q4_a8's function (the same int8 activations, one or two levels, linear_a8.hpp) on Intel AMX
// (Sapphire Rapids and later), for prefill chunks. One TDPBUSD multiplies a 16-row x 32-weight block of unsigned q4
// codes (tile A) by the block's int8 activations of 16 tokens (tile B, 8 rows of 4-byte steps x 16 tokens) into
// 16 x 16 int32 sums (tile C): 8,192 multiply-adds in one instruction, against 32 per vpdpbusd. The scales differ
// per block of 32 (weights: per row; activations: per token), so every block's sums are stored and added into
// float32 accumulators (16 rows x 16 tokens in 16 zmm registers) with the product of the two scales, plus the q4
// min term from the activations' block sums, in linear_a8.hpp's tile's order per block (the levels' combined integer
// sum, then the min term).
// The integer sums are exact, so it equals linear_q4_a8 and linear_q4_vnni bit for bit, one level or two (the engine
// checks this once at load before it lets AMX take a call: models/cpu_linear.py, use_amx).
//
// Availability: the CPU reports AMX-TILE and AMX-INT8 (CPUID leaf 7) and Linux grants the process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM, once); otherwise linear_amx_available() is false and the op raises. Only this
// file's kernel functions are compiled for AVX-512 and AMX (target attributes); the build stays -mavx2.
// Work split: the activations are quantized into B tiles once per call (groups of 16 tokens over ATen's threads);
// then 16-row panels over the threads: per block of kAmxTokenBlock tokens, each panel's codes are unpacked into A
// tiles and every group of 16 tokens of the block runs through them.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "linear.hpp"
#include "linear_a8.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int kAmxRows = 16;             // weight rows per panel: tile A's rows, tile C's rows
constexpr int kAmxTokens = 16;           // tokens per group: tile C's int32 columns
constexpr int64_t kAmxTokenBlock = 256;  // tokens whose B tiles one pass over the panels reads (L2)
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

struct GroupTiles {   // one group of 16 tokens, ready for the tiles
  const int8_t* b[2];     // per level: nb B tiles, each [8 steps][16 tokens][4]
  const float* d;         // [nb][16] block scales
  const float* s;         // [nb][16] block sums
};

// Every token's activations quantized (quantize_row_a8) straight into B tiles, per group of 16 tokens, with the
// scales and block sums transposed to [block][token]; tokens past M in the last group are zeros. Groups split
// over ATen's threads.
class PackedActs {
 public:
  PackedActs(const float* x, int64_t M, int64_t K, int levels)
      : levels_(levels), nb_(K / kActBlock), groups_((M + kAmxTokens - 1) / kAmxTokens),
        tiles_(new int8_t[groups_ * levels * nb_ * kTileBytes]),
        scales_(new float[groups_ * 2 * nb_ * kAmxTokens]) {   // uninitialized: every entry is written
    at::parallel_for(0, groups_, 1, [&](int64_t begin, int64_t end) {
      std::vector<int8_t> row(2 * K);
      std::vector<float> d(nb_), s(nb_);
      for (int64_t gi = begin; gi < end; ++gi) {
        const int64_t tokens = std::min<int64_t>(kAmxTokens, M - gi * kAmxTokens);
        if (tokens < kAmxTokens) zero_group(gi);
        for (int64_t t = 0; t < tokens; ++t) {
          int8_t* a[2] = {row.data(), row.data() + K};
          quantize_row_a8(x + (gi * kAmxTokens + t) * K, K, levels, a, d.data(), s.data());
          scatter(gi, t, row.data(), d.data(), s.data(), K);
        }
      }
    });
  }

  int64_t groups() const { return groups_; }

  GroupTiles group(int64_t gi) const {
    GroupTiles g{};
    for (int l = 0; l < levels_; ++l) g.b[l] = tile(gi, l);
    g.d = scale(gi, 0);
    g.s = scale(gi, 1);
    return g;
  }

 private:
  int8_t* tile(int64_t gi, int l) const { return tiles_.get() + (gi * levels_ + l) * nb_ * kTileBytes; }
  float* scale(int64_t gi, int i) const { return scales_.get() + (gi * 2 + i) * nb_ * kAmxTokens; }   // 0 d, 1 s

  void zero_group(int64_t gi) {
    std::fill(tile(gi, 0), tile(gi, 0) + levels_ * nb_ * kTileBytes, int8_t{0});
    std::fill(scale(gi, 0), scale(gi, 0) + 2 * nb_ * kAmxTokens, 0.0f);
  }

  // Token t of group gi: its int8 row per level (row + l * K) into the B tiles, d and s into [block][token].
  void scatter(int64_t gi, int64_t t, const int8_t* row, const float* d, const float* s, int64_t K) {
    for (int l = 0; l < levels_; ++l) {
      int8_t* b = tile(gi, l);
      for (int64_t blk = 0; blk < nb_; ++blk)
        for (int j = 0; j < 8; ++j)
          std::memcpy(b + blk * kTileBytes + (j * kAmxTokens + t) * 4, row + l * K + blk * 32 + 4 * j, 4);
    }
    float *dl = scale(gi, 0), *sl = scale(gi, 1);
    for (int64_t blk = 0; blk < nb_; ++blk) dl[blk * kAmxTokens + t] = d[blk], sl[blk * kAmxTokens + t] = s[blk];
  }

  int levels_;
  int64_t nb_, groups_;
  std::unique_ptr<int8_t[]> tiles_;
  std::unique_ptr<float[]> scales_;
};

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

// One panel x one token group: C = A . B per block and level, C = 255 * C0 + C1 (kLevels 2: the digits, linear_a8.hpp),
// then acc[r][t] += C * (dw[r] * d[t]), += mw[r] * s[t]. Writes out[t * N + n0 + r] (+ bias) for t < tokens, r < rows.
template <int kLevels>
__attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8"), noinline)) void amx_panel_group(
    const uint8_t* a, const float* dw, const float* mw, int64_t nb, const GroupTiles& g, float* out, int64_t N,
    int64_t n0, int64_t rows, int64_t tokens, const float* bias) {
  alignas(64) int32_t c[2][kAmxRows * kAmxTokens];
  __m512 acc[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    _tile_loadd(2, a + blk * kTileBytes, 32);
    _tile_zero(0);
    _tile_loadd(3, g.b[0] + blk * kTileBytes, 64);
    _tile_dpbusd(0, 2, 3);
    _tile_stored(0, c[0], 64);
    if constexpr (kLevels > 1) {
      _tile_zero(1);
      _tile_loadd(4, g.b[1] + blk * kTileBytes, 64);
      _tile_dpbusd(1, 2, 4);
      _tile_stored(1, c[1], 64);
    }
    const __m512 d0 = _mm512_loadu_ps(g.d + blk * kAmxTokens), sv = _mm512_loadu_ps(g.s + blk * kAmxTokens);
    const float *dwb = dw + blk * kAmxRows, *mwb = mw + blk * kAmxRows;
    for (int r = 0; r < kAmxRows; ++r) {   // the panels' order: the levels' combined sum, then the min term
      __m512i ci = _mm512_load_si512(c[0] + r * kAmxTokens);
      if constexpr (kLevels > 1)
        ci = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(ci, 8), ci), _mm512_load_si512(c[1] + r * kAmxTokens));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ci), _mm512_mul_ps(_mm512_set1_ps(dwb[r]), d0), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mwb[r]), sv, acc[r]);
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
  const PackedActs acts(x, M, K, levels);
  const int64_t block_groups = kAmxTokenBlock / kAmxTokens;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    amx_tiles_on();
    std::vector<uint8_t> a(nb * kTileBytes);
    std::vector<float> dw(nb * kAmxRows), mw(nb * kAmxRows);
    for (int64_t g0 = 0; g0 < acts.groups(); g0 += block_groups) {   // a block's B tiles stay in L2
      const int64_t g1 = std::min(acts.groups(), g0 + block_groups);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kAmxRows, rows = std::min<int64_t>(kAmxRows, N - n0);
        pack_a(codes, scale, min, K, group_size, n0, rows, a.data(), dw.data(), mw.data());
        for (int64_t gi = g0; gi < g1; ++gi) {
          const int64_t t0 = gi * kAmxTokens, tokens = std::min<int64_t>(kAmxTokens, M - t0);
          auto* run = levels > 1 ? &amx_panel_group<2> : &amx_panel_group<1>;
          run(a.data(), dw.data(), mw.data(), nb, acts.group(gi), out + t0 * N, N, n0, rows, tokens, bias);
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
