// Paged attention on CPU for every query row of a step, prefill chunks and decodes alike, read in place from the
// paged KV cache through the block table (PagedAttention, Kwon et al., SOSP 2023): out[r, h] = softmax(scale * q[r, h]
// . K[:, h / G]) V[:, h / G] over the keys its row sees (causal: positions up to its own; a sliding window W: the last
// W of them, transformers' sliding_window), G = H / Hkv query heads per KV head (GQA).
//
// Batch-invariant by construction (attention_lanes.hpp): a row's output is a fixed function of its query and the
// keys and values it sees, bit for bit the same whether it is a decode or a prefill row, whatever chunk its prompt
// was cut into, whatever else runs in the step and however the work falls on threads (each lane of a vector is one
// (row, head) and every operation is lane-wise; the context is cut into splits at fixed absolute positions, merged in
// order). This is what lets the engine give a request the same tokens alone or beside others (after the
// batch-invariant kernels of Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025, and vLLM's
// VLLM_BATCH_INVARIANT mode). 16 lanes (AVX-512F) where the CPU has it, else 8 (AVX2); both give the same values.
// Soft-capping (Gemma 2): each scaled score s becomes c * tanh(s / c). Attention sinks (gpt-oss): head h's softmax
// denominator has one more term exp(sinks[h]), a logit with no value row.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "cache_types.hpp"
#include "cpu_types.hpp"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kSplitKeys = 256;   // keys per split, at absolute positions (the flash-decoding unit)
constexpr int64_t kAheadRows = 32;    // cache rows asked for ahead of the one a decode tile copies

template <class C>
struct AttnArgs {
  const float* q;   // [T, H, D]
  const C *k, *v;   // [blocks, block_size, Hkv, D]
  const int32_t* tables;
  int64_t H, Hkv, D, block_size, max_blocks;
  float scale;
  float softcap;        // 0: none
  const float* sinks;   // [H] or nullptr
};

// 8 lanes: AVX2 + FMA (the build's baseline).
struct Avx2Lanes {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kSlab = 8;     // value dimensions per register slab (accumulators) at one vector of lanes
  static constexpr int kMaxVecs = 1;  // vectors of lanes per tile (16 registers: one)
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V x) { return exp8(x); }
  // x where cond is not -inf, else 0
  static V zero_where_neg_inf(V x, V cond) {
    return _mm256_blendv_ps(x, _mm256_setzero_ps(), _mm256_cmp_ps(cond, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
  }
  // s where lo <= j < hi, else -inf
  static V mask_outside(V s, float j, V lo, V hi) {
    const V jv = _mm256_set1_ps(j);
    const V in = _mm256_and_ps(_mm256_cmp_ps(jv, lo, _CMP_GE_OQ), _mm256_cmp_ps(jv, hi, _CMP_LT_OQ));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, in);
  }
};

}  // namespace

#define VT Avx2Lanes
#define PAGEDSERVE_LANES_NS lanes8
#define PAGEDSERVE_LANES_REGS 16
#include "attention_lanes.hpp"
#undef VT
#undef PAGEDSERVE_LANES_NS
#undef PAGEDSERVE_LANES_REGS

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

namespace {

// exp8's steps on 16 lanes (the same IEEE operations lane for lane, so the same values).
inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.7228f), lo = _mm512_set1_ps(-87.3365f);
  const __m512 xc = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_ps());
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), y, _mm512_set1_ps(INFINITY));
}

// 16 lanes: AVX-512F, compiled for that target only (this pragma region), run where the CPU reports it.
struct Avx512Lanes {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kSlab = 16;
  static constexpr int kMaxVecs = 2;  // prefill tiles of 32 lanes: each key element broadcast once for both vectors
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V x) { return exp16(x); }
  static V zero_where_neg_inf(V x, V cond) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(cond, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), x,
                                _mm512_setzero_ps());
  }
  static V mask_outside(V s, float j, V lo, V hi) {
    const V jv = _mm512_set1_ps(j);
    const __mmask16 in = _mm512_cmp_ps_mask(jv, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(jv, hi, _CMP_LT_OQ);
    return _mm512_mask_blend_ps(in, _mm512_set1_ps(-INFINITY), s);
  }
};

}  // namespace

#define VT Avx512Lanes
#define PAGEDSERVE_LANES_NS lanes16
#define PAGEDSERVE_LANES_REGS 32
#include "attention_lanes.hpp"
#undef VT
#undef PAGEDSERVE_LANES_NS
#undef PAGEDSERVE_LANES_REGS

#pragma GCC pop_options

namespace {

bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

std::atomic<bool> g_avx512_on{true};   // paged_attention_avx512: off runs the AVX2 code where AVX-512 is present

bool attention_avx512() { return cpu_has_avx512() && g_avx512_on.load(std::memory_order_relaxed); }

// The rows of one call: row r belongs to sequence row_seq[r] and sits at absolute position row_pos[r] (rows of a
// sequence consecutive); a row with row_seq -1 is padding (output zeros).
struct RowPlan {
  std::vector<int32_t> seq, pos;
};

template <class Tile>
std::vector<Tile> make_tiles(const RowPlan& rows, int64_t H, int64_t Hkv, int64_t window, int lanes) {
  const int64_t T = static_cast<int64_t>(rows.seq.size()), G = H / Hkv;
  const int64_t heads_per_tile = std::min<int64_t>(G, lanes), rows_per_tile = std::max<int64_t>(1, lanes / G);
  std::vector<Tile> tiles;
  for (int64_t r0 = 0; r0 < T;) {
    if (rows.seq[r0] < 0) { ++r0; continue; }
    int64_t r1 = r0 + 1;
    while (r1 < T && r1 - r0 < rows_per_tile && rows.seq[r1] == rows.seq[r0]) ++r1;
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t g0 = 0; g0 < G; g0 += heads_per_tile) {
        Tile t{};
        t.seq = rows.seq[r0];
        t.kvh = kvh;
        t.key_lo = INT64_MAX;
        t.key_hi = 0;
        t.one_row = r1 - r0 == 1;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t g = g0; g < std::min(G, g0 + heads_per_tile); ++g) {
            const int64_t l = t.lanes++, hi = rows.pos[r] + 1, lo = window > 0 ? std::max<int64_t>(0, hi - window) : 0;
            t.out_row[l] = r;
            t.out_head[l] = kvh * G + g;
            t.lo[l] = static_cast<float>(lo);
            t.hi[l] = static_cast<float>(hi);
            t.key_lo = std::min(t.key_lo, lo);
            t.key_hi = std::max(t.key_hi, hi);
          }
        tiles.push_back(t);
      }
    r0 = r1;
  }
  return tiles;
}

// Splits run as items of their own (then merged) when the tiles alone would leave threads idle: fewer than a few
// tiles per thread, some context of two splits or more. The values do not depend on it.
template <class Tile>
bool use_split_items(const std::vector<Tile>& tiles, int64_t max_splits, int64_t width) {
  if (max_splits == 1) return false;
  int64_t longest = 0;
  for (const Tile& t : tiles) {
    if (t.lanes > width) return false;   // split items take one vector of lanes (decode tiles)
    longest = std::max(longest, (t.key_hi + kSplitKeys - 1) / kSplitKeys - t.key_lo / kSplitKeys);
  }
  return longest >= 2 && static_cast<int64_t>(tiles.size()) < 4 * at::get_num_threads();
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const RowPlan& rows, double scale, int64_t max_splits,
                  int64_t sliding_window, double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be float32 [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && is_cache_type(k_cache.scalar_type()) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
              "k_cache, v_cache must be contiguous float32, float16 or bfloat16 [blocks, block_size, Hkv, D] "
              "of one dtype");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [B, max_blocks]");
  const int64_t H = q.size(1), D = q.size(2), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0), B = block_tables.size(0);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0, "head_dim must match and be a multiple of 8");
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(max_splits >= 0, "max_splits must be >= 0 (0: chosen by the kernel)");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: no window)");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == H && sinks->scalar_type() == at::kFloat &&
                                     sinks->is_contiguous()),
              "sinks must be contiguous float32 [H]");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (size_t r = 0; r < rows.seq.size(); ++r) {   // the blocks read: those holding the keys the row sees
    const int64_t s = rows.seq[r];
    if (s < 0) continue;
    TORCH_CHECK(s < B, "sequence index out of range for row ", r);
    const int64_t hi = rows.pos[r] + 1, lo = sliding_window > 0 ? std::max<int64_t>(0, hi - sliding_window) : 0;
    TORCH_CHECK(rows.pos[r] >= 0 && hi <= max_blocks * block_size, "context length out of range for row ", r);
    for (int64_t b = lo / block_size; b < (hi + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "block id out of range for sequence ", s);
  }
  at::Tensor out = at::zeros(q.sizes(), q.options());
  const float* sinks_p = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  AT_DISPATCH_SWITCH(k_cache.scalar_type(), "paged_attention", PAGEDSERVE_CACHE_TYPE_CASES([&] {
    const AttnArgs<scalar_t> args{q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                  tables, H, Hkv, D, block_size, max_blocks, static_cast<float>(scale),
                                  static_cast<float>(softcap), sinks_p};
    if (attention_avx512()) {
      // one-row sequences (decodes) on 8 lanes: a decode row fills only G of them (3 for the embedded model), and
      // the 8- and 16-lane code give the same values, so the narrower vectors halve its wasted work
      RowPlan single = rows, multi = rows;
      for (size_t r = 0; r < rows.seq.size(); ++r) {
        const bool alone = rows.seq[r] >= 0 && (r == 0 || rows.seq[r - 1] != rows.seq[r]) &&
                           (r + 1 == rows.seq.size() || rows.seq[r + 1] != rows.seq[r]);
        (alone ? multi : single).seq[r] = -1;
      }
      const auto narrow = make_tiles<lanes8::Tile>(single, H, Hkv, sliding_window, 8);
      if (!narrow.empty()) lanes8::run(args, narrow, use_split_items(narrow, max_splits, 8), out.data_ptr<float>());
      const auto tiles = make_tiles<lanes16::Tile>(multi, H, Hkv, sliding_window, lanes16::kMaxLanes);
      if (!tiles.empty()) lanes16::run(args, tiles, use_split_items(tiles, max_splits, 16), out.data_ptr<float>());
    } else {
      const auto tiles = make_tiles<lanes8::Tile>(rows, H, Hkv, sliding_window, lanes8::kMaxLanes);
      lanes8::run(args, tiles, use_split_items(tiles, max_splits, 8), out.data_ptr<float>());
    }
  }));
  return out;
}

}  // namespace

int64_t paged_attention_lanes() { return attention_avx512() ? 16 : 8; }

bool paged_attention_avx512(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "mode must be -1 (query), 0 (off) or 1 (on where the CPU has AVX-512)");
  if (mode >= 0) g_avx512_on.store(mode == 1, std::memory_order_relaxed);
  return attention_avx512();
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& context_lens, double scale, int64_t sliding_window, double softcap,
                           const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt &&
                  context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt &&
                  query_start_loc.size(0) == context_lens.size(0) + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) == context_lens.size(0),
              "query_start_loc must be int32 [B + 1], context_lens int32 [B], block_tables [B, max_blocks]");
  TORCH_CHECK(q.dim() == 3, "q must be float32 [T, H, D]");
  const at::Tensor qsl = query_start_loc.contiguous(), lens = context_lens.contiguous();
  const int32_t *qs = qsl.data_ptr<int32_t>(), *cl = lens.data_ptr<int32_t>();
  const int64_t B = lens.size(0), T = q.size(0);
  TORCH_CHECK(qs[0] == 0 && qs[B] <= T, "query_start_loc must start at 0 and end at most at T");
  RowPlan rows{std::vector<int32_t>(T, -1), std::vector<int32_t>(T, 0)};
  for (int64_t s = 0; s < B; ++s) {
    const int64_t n = qs[s + 1] - qs[s];
    TORCH_CHECK(n >= 0 && cl[s] >= n, "sequence ", s, ": query_len ", n, " must be within 0..context_len ", cl[s]);
    for (int64_t i = 0; i < n; ++i) {
      rows.seq[qs[s] + i] = static_cast<int32_t>(s);
      rows.pos[qs[s] + i] = static_cast<int32_t>(cl[s] - n + i);
    }
  }
  return attend(q, k_cache, v_cache, block_tables, rows, scale, 0, sliding_window, softcap, sinks);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t max_splits, int64_t sliding_window, double softcap,
                                  const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3, "q must be float32 [S, H, D]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt, "context_lens must be int32 [S]");
  const int64_t S = q.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && context_lens.size(0) == S,
              "one block table row and length per sequence");
  const at::Tensor lens = context_lens.contiguous();
  const int32_t* cl = lens.data_ptr<int32_t>();
  RowPlan rows{std::vector<int32_t>(S), std::vector<int32_t>(S)};
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(cl[s] >= 1, "context length out of range for sequence ", s);
    rows.seq[s] = static_cast<int32_t>(s);
    rows.pos[s] = cl[s] - 1;
  }
  return attend(q, k_cache, v_cache, block_tables, rows, scale, max_splits, sliding_window, softcap, sinks);
}

}  // namespace pagedserve::cpu
