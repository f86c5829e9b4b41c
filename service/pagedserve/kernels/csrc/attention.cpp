#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "cache_types.hpp"
#include "cpu_types.hpp"
#include "ops.h"

// Paged decode attention: one query token per sequence against its whole context in the paged KV cache, read in
// place through the block table (no gather). out[s, h] = softmax(scale * q[s, h] . K[s, :, h / G]) V[s, :, h / G]
// with G = H / Hkv query heads per KV head (GQA). Work item: (sequence, query head), so that even one sequence
// spreads over the threads; the G heads of one KV head are adjacent items, so a thread mostly reads a K/V row
// from L1/L2 after its first head. Scores go to a per-thread buffer [context]; softmax in float32 with the row
// maximum subtracted (exp8). Context rows are walked a cache block at a time (no per-token division).

namespace pagedserve::cpu {
namespace {

template <class C>
struct DecodeArgs {
  const float* q;
  const C *k, *v;
  const int32_t *tables, *lens;
  float* out;
  int64_t H, Hkv, D, block_size, max_blocks;
  float scale;
};

// One (sequence s, query head h); DV = D / 8 vectors per row (DV = 0: D read at run time); C the cache type.
template <int DV, class C>
void decode_head(const DecodeArgs<C>& a, int64_t s, int64_t h, std::vector<float>& scores) {
  const int64_t D = DV ? DV * 8 : a.D, nv = D / 8, len = a.lens[s], G = a.H / a.Hkv, kvh = h / G;
  const int64_t row_stride = a.Hkv * D, bs = a.block_size;
  const int32_t* table = a.tables + s * a.max_blocks;
  const float* qh = a.q + (s * a.H + h) * D;
  scores.resize(len);
  float* row = scores.data();
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const C* k0 = a.k + (static_cast<int64_t>(table[t0 / bs]) * bs * a.Hkv + kvh) * D;
    const int64_t n = std::min(bs, len - t0);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {       // four tokens at a time: one reduction for four scores
      const C* kr = k0 + i * row_stride;
      __m256 acc[4];
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < nv; ++d) {
        const __m256 qv = _mm256_loadu_ps(qh + 8 * d);
        for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(kr + j * row_stride + 8 * d), acc[j]);
      }
      _mm_storeu_ps(row + t0 + i, _mm_mul_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(a.scale)));
    }
    for (; i < n; ++i) {
      const C* kr = k0 + i * row_stride;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < nv; ++d) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * d), load8(kr + 8 * d), acc);
      row[t0 + i] = hsum(acc) * a.scale;
    }
  }
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(row + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx8);
  float mx = *std::max_element(lanes, lanes + 8);
  for (; t < len; ++t) mx = std::max(mx, row[t]);
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), mxv));
    _mm256_storeu_ps(row + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; t < len; ++t) {
    row[t] = std::exp(row[t] - mx);
    sum += row[t];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  float* o = a.out + (s * a.H + h) * D;
  for (int64_t d0 = 0; d0 < nv; d0 += 8) {   // the output in chunks of up to 8 vectors held in registers
    const int64_t m = std::min<int64_t>(8, nv - d0);
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t u0 = 0; u0 < len; u0 += bs) {
      const C* vr = a.v + (static_cast<int64_t>(table[u0 / bs]) * bs * a.Hkv + kvh) * D + 8 * d0;
      const int64_t n = std::min(bs, len - u0);
      for (int64_t i = 0; i < n; ++i, vr += row_stride) {
        const __m256 p = _mm256_set1_ps(row[u0 + i]);
        if (DV == 8) {
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(p, load8(vr + 8 * j), acc[j]);
        } else {
          for (int j = 0; j < m; ++j) acc[j] = _mm256_fmadd_ps(p, load8(vr + 8 * j), acc[j]);
        }
      }
    }
    for (int j = 0; j < m; ++j) _mm256_storeu_ps(o + 8 * (d0 + j), _mm256_mul_ps(acc[j], inv));
  }
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be float32 [S, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && is_cache_type(k_cache.scalar_type()) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
              "k_cache, v_cache must be contiguous float32, float16 or bfloat16 [blocks, block_size, Hkv, D] "
              "of one dtype");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [S, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt, "context_lens must be int32 [S]");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0, "head_dim must match and be a multiple of 8");
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == S && context_lens.size(0) == S, "one block table row and length per sequence");
  const at::Tensor lens_tensor = context_lens.contiguous();   // kept alive: lens points into it
  const int32_t* lens = lens_tensor.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "context length out of range for sequence ", s);
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "block id out of range for sequence ", s);
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_SWITCH(k_cache.scalar_type(), "paged_decode_attention", PAGEDSERVE_CACHE_TYPE_CASES([&] {
    const DecodeArgs<scalar_t> args{q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                    tables, lens, out.data_ptr<float>(), H, Hkv, D, block_size, max_blocks,
                                    static_cast<float>(scale)};
    at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        if (D == 64) decode_head<8>(args, item / H, item % H, scores);
        else if (D == 128) decode_head<16>(args, item / H, item % H, scores);
        else decode_head<0>(args, item / H, item % H, scores);
      }
    });
  }));
  return out;
}

}  // namespace pagedserve::cpu
