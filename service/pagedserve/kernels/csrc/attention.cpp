#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "cache_types.hpp"
#include "cpu_types.hpp"
#include "ops.h"

// Paged decode attention: one query token per sequence against its whole context in the paged KV cache, read in
// place through the block table (no gather). out[s, h] = softmax(scale * q[s, h] . K[s, :, h / G]) V[s, :, h / G]
// with G = H / Hkv query heads per KV head (GQA).
//
// Work item: (sequence, KV head, context split). The G query heads of a KV head are computed together, a few cache
// rows at a time, so each K/V row comes from memory once per step and is reused from L1 by the other G - 1 heads.
// When there are fewer (sequence, KV head) pairs than a few per thread (one or two long requests), each context is
// cut into splits (flash-decoding, Dao et al. 2023): every split gives per head its score maximum m, its sum of
// exp(score - m) l and the unnormalised output o = sum exp(score - m) v, and a second pass merges the splits:
// out = sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p with M = max_p m_p. Softmax in float32 (exp8).
// With a sliding window W > 0 a sequence of len rows attends to its last min(len, W) rows only (its query sits at
// position len - 1 and sees positions len - W .. len - 1: transformers' sliding_window), and only those are read.
// Soft-capping (Gemma 2): with softcap c > 0 each scaled score s becomes c * tanh(s / c) before the softmax.
// Attention sinks (gpt-oss): with sinks, head h's softmax denominator has one more term exp(sinks[h]), a logit with
// no value row (the sink takes probability mass and gives nothing back): out = sum exp(s - M) v / (sum exp(s - M) +
// exp(sinks[h] - M)), M the maximum over the scores and the sink.

namespace pagedserve::cpu {
namespace {

constexpr int64_t kMinSplitTokens = 64;   // a split shorter than this costs more in merging than it balances

template <class C>
struct DecodeArgs {
  const float* q;
  const C *k, *v;
  const int32_t *tables, *lens;
  int64_t H, Hkv, D, block_size, max_blocks;
  float scale;
  float softcap;        // 0: none
  const float* sinks;   // [H] or nullptr
};

// Walks the cache rows [t_lo, t_hi) of sequence s and KV head kvh a block run at a time: f(first row, rows, offset
// of the run from t_lo); consecutive rows of a run are row_stride = Hkv * D elements apart.
template <class C, class F>
inline void for_each_run(const DecodeArgs<C>& a, const C* cache, int64_t s, int64_t kvh, int64_t t_lo, int64_t t_hi,
                         F&& f) {
  const int32_t* table = a.tables + s * a.max_blocks;
  const int64_t bs = a.block_size;
  for (int64_t t = t_lo; t < t_hi;) {
    const int64_t off = t % bs, n = std::min(bs - off, t_hi - t);
    f(cache + ((static_cast<int64_t>(table[t / bs]) * bs + off) * a.Hkv + kvh) * a.D, n, t - t_lo);
    t += n;
  }
}

// The G = H / Hkv heads of KV head kvh of sequence s over context rows [t_lo, t_hi) (non-empty): m[g], l[g] and the
// unnormalised o[g * D : (g + 1) * D]. DV = D / 8 vectors per row (DV = 0: D read at run time); C the cache type.
// scores: scratch, resized to G * (t_hi - t_lo).
template <int DV, class C>
void decode_group(const DecodeArgs<C>& a, int64_t s, int64_t kvh, int64_t t_lo, int64_t t_hi,
                  std::vector<float>& scores, float* o, float* m, float* l) {
  const int64_t D = DV ? DV * 8 : a.D, nv = D / 8, G = a.H / a.Hkv, n_ctx = t_hi - t_lo;
  const int64_t row_stride = a.Hkv * D;
  const float* q0 = a.q + (s * a.H + kvh * G) * D;
  scores.resize(G * n_ctx);
  float* sc = scores.data();
  const __m128 scale4 = _mm_set1_ps(a.scale);
  for_each_run(a, a.k, s, kvh, t_lo, t_hi, [&](const C* k0, int64_t n, int64_t at) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {   // four rows at a time (one reduction for four scores), every head on them
      const C* kr = k0 + i * row_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qh = q0 + g * D;
        __m256 acc[4];
        for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < nv; ++d) {
          const __m256 qv = _mm256_loadu_ps(qh + 8 * d);
          for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(kr + j * row_stride + 8 * d), acc[j]);
        }
        _mm_storeu_ps(sc + g * n_ctx + at + i, _mm_mul_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), scale4));
      }
    }
    for (; i < n; ++i) {
      const C* kr = k0 + i * row_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qh = q0 + g * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < nv; ++d) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * d), load8(kr + 8 * d), acc);
        sc[g * n_ctx + at + i] = hsum(acc) * a.scale;
      }
    }
  });
  if (a.softcap > 0.0f) {   // Gemma 2's soft-capping of the scaled scores
    const float inv_cap = 1.0f / a.softcap;
    for (int64_t i = 0; i < G * n_ctx; ++i) sc[i] = a.softcap * std::tanh(sc[i] * inv_cap);
  }
  for (int64_t g = 0; g < G; ++g) {   // softmax numerators in place: exp(score - m)
    float* row = sc + g * n_ctx;
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n_ctx; t += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(row + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx8);
    float mx = *std::max_element(lanes, lanes + 8);
    for (; t < n_ctx; ++t) mx = std::max(mx, row[t]);
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n_ctx; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), mxv));
      _mm256_storeu_ps(row + t, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    for (; t < n_ctx; ++t) {
      row[t] = std::exp(row[t] - mx);
      sum += row[t];
    }
    m[g] = mx;
    l[g] = sum;
  }
  std::fill_n(o, G * D, 0.0f);
  for_each_run(a, a.v, s, kvh, t_lo, t_hi, [&](const C* v0, int64_t n, int64_t at) {
    for (int64_t g = 0; g < G; ++g) {   // the run's V rows (at most a block) stay in L1 across the heads
      const float* p = sc + g * n_ctx + at;
      float* og = o + g * D;
      for (int64_t d0 = 0; d0 < nv; d0 += 8) {   // up to 8 output vectors in registers
        const int64_t mv = std::min<int64_t>(8, nv - d0);
        __m256 acc[8];
        for (int j = 0; j < mv; ++j) acc[j] = _mm256_loadu_ps(og + 8 * (d0 + j));
        const C* vr = v0 + 8 * d0;
        for (int64_t i = 0; i < n; ++i, vr += row_stride) {
          const __m256 pv = _mm256_set1_ps(p[i]);
          if (DV == 8) {
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pv, load8(vr + 8 * j), acc[j]);
          } else {
            for (int j = 0; j < mv; ++j) acc[j] = _mm256_fmadd_ps(pv, load8(vr + 8 * j), acc[j]);
          }
        }
        for (int j = 0; j < mv; ++j) _mm256_storeu_ps(og + 8 * (d0 + j), acc[j]);
      }
    }
  });
}

template <class C>
void decode_group_dispatch(const DecodeArgs<C>& a, int64_t s, int64_t kvh, int64_t t_lo, int64_t t_hi,
                           std::vector<float>& scores, float* o, float* m, float* l) {
  if (a.D == 64) decode_group<8>(a, s, kvh, t_lo, t_hi, scores, o, m, l);
  else if (a.D == 128) decode_group<16>(a, s, kvh, t_lo, t_hi, scores, o, m, l);
  else decode_group<0>(a, s, kvh, t_lo, t_hi, scores, o, m, l);
}

// Splits per context: 1 when the (sequence, KV head) pairs already give each thread several items; otherwise enough
// that the items divide evenly over the threads, at least kMinSplitTokens rows each. max_splits > 0 caps it.
int64_t choose_splits(int64_t pairs, int64_t max_len, int64_t threads, int64_t max_splits) {
  const int64_t by_len = std::max<int64_t>(1, max_len / kMinSplitTokens);
  int64_t p = 1;
  if (pairs < 4 * threads) {
    p = (4 * threads + pairs - 1) / pairs;
    for (int64_t extra = 0; extra < threads && (pairs * p) % threads; ++extra) ++p;
  }
  p = std::min(p, by_len);
  return max_splits > 0 ? std::min(p, max_splits) : p;
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t max_splits, int64_t sliding_window, double softcap,
                                  const c10::optional<at::Tensor>& sinks) {
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
  TORCH_CHECK(max_splits >= 0, "max_splits must be >= 0 (0: chosen by the kernel)");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: no window)");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == q.size(1) &&
                                     sinks->scalar_type() == at::kFloat && sinks->is_contiguous()),
              "sinks must be contiguous float32 [H]");
  const float* sinks_p = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const at::Tensor lens_tensor = context_lens.contiguous();   // kept alive: lens points into it
  const int32_t* lens = lens_tensor.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  // The first row each sequence attends to: 0, or with a window the first row inside it.
  auto first_row = [&](int64_t s) -> int64_t {
    return sliding_window > 0 ? std::max<int64_t>(0, lens[s] - sliding_window) : 0;
  };
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < S; ++s) {   // the blocks read: those holding rows [first_row, len)
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "context length out of range for sequence ", s);
    for (int64_t b = first_row(s) / block_size; b < (lens[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "block id out of range for sequence ", s);
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  int64_t max_len = 0;
  for (int64_t s = 0; s < S; ++s) max_len = std::max<int64_t>(max_len, lens[s] - first_row(s));
  const int64_t G = H / Hkv, pairs = S * Hkv;
  const int64_t P = choose_splits(pairs, max_len, at::get_num_threads(), max_splits);
  // With P > 1, split p of the rows [first, len) covers [first + p * chunk, min(len, first + (p + 1) * chunk)), chunk =
  // ceil((len - first) / P) rounded up to whole cache blocks; a split past the end is empty (l = 0) and drops out of
  // the merge.
  std::vector<float> partial(P > 1 ? pairs * P * G * (D + 2) : 0);
  AT_DISPATCH_SWITCH(k_cache.scalar_type(), "paged_decode_attention", PAGEDSERVE_CACHE_TYPE_CASES([&] {
    const DecodeArgs<scalar_t> args{q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                    tables, lens, H, Hkv, D, block_size, max_blocks, static_cast<float>(scale),
                                    static_cast<float>(softcap), sinks_p};
    float* out_p = out.data_ptr<float>();
    at::parallel_for(0, pairs * P, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, o(P > 1 ? 0 : G * D), ml(P > 1 ? 0 : 2 * G);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t pair = item / P, p = item % P, s = pair / Hkv, kvh = pair % Hkv, len = lens[s];
        const int64_t first = first_row(s);
        if (P == 1) {
          decode_group_dispatch(args, s, kvh, first, len, scores, o.data(), ml.data(), ml.data() + G);
          for (int64_t g = 0; g < G; ++g) {
            float w = 1.0f, denom = ml[G + g];
            if (sinks_p) {   // M = max(m, sink): o and l are relative to m
              const float m = ml[g], sink = sinks_p[kvh * G + g], mx = std::max(m, sink);
              w = std::exp(m - mx);
              denom = w * denom + std::exp(sink - mx);
            }
            const float inv = w / denom;
            float* dst = out_p + (s * H + kvh * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = o[g * D + d] * inv;
          }
          continue;
        }
        float* rec = partial.data() + item * G * (D + 2);   // [m (G), l (G), o (G x D)]
        const int64_t chunk = ((len - first + P - 1) / P + block_size - 1) / block_size * block_size;
        const int64_t lo = std::min(len, first + p * chunk), hi = std::min(len, lo + chunk);
        if (lo == hi) {
          std::fill_n(rec, G, -INFINITY);
          std::fill_n(rec + G, G, 0.0f);
          continue;
        }
        decode_group_dispatch(args, s, kvh, lo, hi, scores, rec + 2 * G, rec, rec + G);
      }
    });
    if (P > 1) {
      at::parallel_for(0, S * H, 16, [&](int64_t begin, int64_t end) {
        for (int64_t sh = begin; sh < end; ++sh) {
          const int64_t s = sh / H, h = sh % H, kvh = h / G, g = h % G;
          const float* base = partial.data() + (s * Hkv + kvh) * P * G * (D + 2);
          float mx = -INFINITY;
          for (int64_t p = 0; p < P; ++p) mx = std::max(mx, base[p * G * (D + 2) + g]);
          if (sinks_p) mx = std::max(mx, sinks_p[h]);
          float denom = sinks_p ? std::exp(sinks_p[h] - mx) : 0.0f;
          float* dst = out_p + sh * D;
          std::fill_n(dst, D, 0.0f);
          for (int64_t p = 0; p < P; ++p) {
            const float* rec = base + p * G * (D + 2);
            if (rec[G + g] == 0.0f) continue;   // an empty split
            const float w = std::exp(rec[g] - mx);
            denom += w * rec[G + g];
            const float* op = rec + 2 * G + g * D;
            for (int64_t d = 0; d < D; ++d) dst[d] += w * op[d];
          }
          const float inv = 1.0f / denom;
          for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
        }
      });
    }
  }));
  return out;
}

}  // namespace pagedserve::cpu
