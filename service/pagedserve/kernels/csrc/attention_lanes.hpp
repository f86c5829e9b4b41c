// The body of paged_attention (attention.cpp), written once over a vector type VT and included twice: with VT =
// Avx2Lanes (8 lanes) in namespace lanes8, and with VT = Avx512Lanes (16 lanes) under the AVX-512 target pragma in
// namespace lanes16. No include guard: it is meant to be included once per vector type.
//
// One lane is one (query row, query head). A tile is up to W lanes of one sequence and one KV head: R consecutive
// rows of the sequence times the G = H / Hkv query heads of the KV head (G > W: the heads in groups of W). Every
// operation below is lane-wise, so a lane's result is the same function of its query, its keys and its values
// whatever else shares its tile, its step or its thread; between the 8- and 16-lane builds the lane-wise IEEE
// operations are the same too. Per lane, keys [lo, hi) (hi = position + 1; lo = hi - window, or 0):
//   the context in splits of kSplitKeys keys at absolute positions (split s: keys [s * 256, s * 256 + 256));
//   per split, two passes: s_j = (fma chain over d = 0..D-1 of q[d] * k_j[d], from 0) * scale (softcapped:
//   c * tanh(s / c)), -inf outside [lo, hi); m = max_j s_j; p_j = exp(s_j - m) (0 where m is -inf); l = sum_j p_j in
//   key order; o[d] = fma chain over j in key order of p_j * v_j[d], from 0;
//   the splits merged in order from (m, l, o) = (-inf, 0, 0): M' = max(M, m), a = exp(M - M'), b = exp(m - M') (0 for
//   a -inf side), L = L * a + l * b, O = O * a + o * b;
//   with sinks, M'' = max(M, sink), L = L * exp(M - M'') + exp(sink - M''), O *= exp(M - M''); out = O * (1 / L).
// A split's partial state depends on that split's keys only, so splits may run on different threads (decode of a few
// long sequences) and be merged afterwards with the same result as one thread running them in turn.

namespace PAGEDSERVE_LANES_NS {

using V = VT::V;
constexpr int W = VT::W;
constexpr int kMaxVecs = VT::kMaxVecs;   // vectors of lanes per tile at most (prefill tiles; a decode tile has one)
constexpr int kMaxLanes = kMaxVecs * W;
constexpr int kRegs = PAGEDSERVE_LANES_REGS;   // vector registers the target has (16 for AVX2, 32 with AVX-512)

// One tile: up to kMaxLanes lanes (NV = ceil(lanes / W) vectors of them), their key bounds.
struct Tile {
  int64_t seq, kvh, lanes;
  int64_t key_lo, key_hi;   // the union of the lanes' key ranges
  bool one_row;             // every lane of one query row (then every lane has [key_lo, key_hi))
  int64_t out_row[kMaxLanes], out_head[kMaxLanes];
  alignas(64) float lo[kMaxLanes];   // per lane; unused lanes have lo = hi = 0 (every key masked)
  alignas(64) float hi[kMaxLanes];
};

// The cache rows of keys [j0, j1) of the tile's KV head (at most kSplitKeys), walked block by block (one table
// lookup and no division per key). Returns j1 - j0.
template <class C>
int64_t row_sources(const AttnArgs<C>& a, const C* cache, const Tile& t, int64_t j0, int64_t j1, const C** src) {
  const int32_t* table = a.tables + t.seq * a.max_blocks;
  const int64_t stride = a.Hkv * a.D;
  for (int64_t j = j0; j < j1;) {
    const int64_t b = j / a.block_size, end = std::min(j1, (b + 1) * a.block_size);
    const C* p = cache + (static_cast<int64_t>(table[b]) * a.block_size + (j - b * a.block_size)) * stride +
                 t.kvh * a.D;
    for (; j < end; ++j, p += stride) src[j - j0] = p;
  }
  return std::max<int64_t>(0, j1 - j0);
}

// Rows src[0..n) as float32 pointers: the cache rows themselves for float32 unless `copy`, else widened (or copied)
// into buf, row i + kAheadRows asked for while row i is copied and, past the end, then[0..then_n) (the rows read next):
// a sequence's blocks are scattered, so the hardware prefetchers cannot follow a block table.
template <class C>
void key_rows(const AttnArgs<C>& a, const C* const* src, int64_t n, float* buf, const float** rows, bool copy,
              const C* const* then = nullptr, int64_t then_n = 0) {
  if (!copy && std::is_same_v<C, float>) {
    for (int64_t i = 0; i < n; ++i) rows[i] = reinterpret_cast<const float*>(src[i]);
    return;
  }
  const auto fetch = [&](const C* p) {
    for (int64_t d = 0; d < a.D; d += 64 / static_cast<int64_t>(sizeof(C)))
      _mm_prefetch(reinterpret_cast<const char*>(p + d), _MM_HINT_T0);
  };
  for (int64_t i = 0; i < std::min(n, kAheadRows); ++i) fetch(src[i]);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAheadRows < n) fetch(src[i + kAheadRows]);
    else if (i + kAheadRows - n < then_n) fetch(then[i + kAheadRows - n]);
    float* dst = buf + i * a.D;
    for (int64_t d = 0; d < a.D; d += 8) _mm256_storeu_ps(dst + d, load8(src[i] + d));
    rows[i] = dst;
  }
}

// Scores of keys [0, n) (rows[j]) for the tile's NV * W lanes into sc[(j * NV + v) * W + lane], 8 keys at a time (8
// independent fma chains per vector, each key element broadcast once for the NV vectors); the masked ones -inf. j0:
// the absolute position of key 0. qt[(d * NV + v) * W + lane].
// Not inlined (nor pv_slab): inlined into run's loop they ran a prefill tile 1.6x slower (GCC 12, -O3).
template <int NV>
__attribute__((noinline)) void scores(const float* qt, int64_t D, const float* const* rows, int64_t n, int64_t j0,
                                      const Tile& t, float scale, float softcap, float* sc) {
  V lo[NV], hi[NV];
  for (int v = 0; v < NV; ++v) lo[v] = VT::load(t.lo + v * W), hi[v] = VT::load(t.hi + v * W);
  const V sv = VT::set1(scale);
  for (int64_t j = 0; j < n; j += 8) {
    const float* r[8];
    for (int i = 0; i < 8; ++i) r[i] = rows[std::min<int64_t>(j + i, n - 1)];   // past n: a repeat, dropped
    V acc[8][NV];
    for (int i = 0; i < 8; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = VT::zero();
    for (int64_t d = 0; d < D; ++d) {
      V qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = VT::load(qt + (d * NV + v) * W);
      for (int i = 0; i < 8; ++i) {
        const V kv = VT::set1(r[i][d]);
        for (int v = 0; v < NV; ++v) acc[i][v] = VT::fma(qv[v], kv, acc[i][v]);
      }
    }
    for (int i = 0; i < 8 && j + i < n; ++i)
      for (int v = 0; v < NV; ++v) {
        V s = VT::mul(acc[i][v], sv);
        if (softcap > 0.0f) {
          alignas(64) float tmp[W];
          VT::store(tmp, s);
          for (int l = 0; l < W; ++l) tmp[l] = softcap * std::tanh(tmp[l] / softcap);
          s = VT::load(tmp);
        }
        VT::store(sc + ((j + i) * NV + v) * W, VT::mask_outside(s, static_cast<float>(j0 + j + i), lo[v], hi[v]));
      }
  }
}

// o[(d * NV + v) * W + lane] = sum_j p[(j * NV + v) * W + lane] * rows[j][d] for d in [d0, d0 + NA), keys in order.
template <int NA, int NV>
__attribute__((noinline)) void pv_slab(const float* p, const float* const* rows, int64_t n, int64_t d0, float* o) {
  V acc[NA][NV];
  for (int i = 0; i < NA; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = VT::zero();
  for (int64_t j = 0; j < n; ++j) {
    V pj[NV];
    for (int v = 0; v < NV; ++v) pj[v] = VT::load(p + (j * NV + v) * W);
    const float* r = rows[j] + d0;
    for (int i = 0; i < NA; ++i) {
      const V x = VT::set1(r[i]);
      for (int v = 0; v < NV; ++v) acc[i][v] = VT::fma(pj[v], x, acc[i][v]);
    }
  }
  for (int i = 0; i < NA; ++i)
    for (int v = 0; v < NV; ++v) VT::store(o + ((d0 + i) * NV + v) * W, acc[i][v]);
}

#include "attention_decode.hpp"   // scores_by_key, pv_by_dim: the decode tiles

// A decode unit: one query row, its lanes the query heads of one KV head (split_state's keys-in-lanes code).
inline bool decode_tile(const Tile& t) { return t.one_row && t.lanes <= 8; }

// The first key rows of split s of tile t into src (none unless a decode tile): what split_state reads first.
template <class C>
int64_t first_keys(const AttnArgs<C>& a, const Tile& t, int64_t s, const C** src) {
  if (!decode_tile(t)) return 0;
  const int64_t j0 = std::max(t.key_lo, s * kSplitKeys);
  return row_sources(a, a.k, t, j0, std::min({t.key_hi, (s + 1) * kSplitKeys, j0 + kAheadRows}), src);
}

// Per-thread buffers for one tile's split.
struct Scratch {
  std::vector<float> qt, sc, kbuf, vbuf;
  std::vector<const float*> krows, vrows;
  void reserve(int64_t D) {
    qt.resize(D * kMaxLanes);
    sc.resize(kSplitKeys * kMaxLanes);
    kbuf.resize(kSplitKeys * D);
    vbuf.resize(kSplitKeys * D);
    krows.resize(kSplitKeys);
    vrows.resize(kSplitKeys);
  }
};

// Split s of the tile (NV vectors of lanes): m[NV * W], l[NV * W], o[D * NV * W] (lane-minor).
// next_k[0..next_n): the first key rows of the unit this thread computes next, asked for while the values are read.
template <int NV, class C>
void split_state(const AttnArgs<C>& a, const Tile& t, int64_t s, Scratch& w, float* m, float* l, float* o,
                 const C* const* next_k = nullptr, int64_t next_n = 0) {
  const int64_t j0 = std::max(t.key_lo, s * kSplitKeys), j1 = std::min(t.key_hi, (s + 1) * kSplitKeys), n = j1 - j0;
  if (n <= 0) {
    for (int v = 0; v < NV; ++v) VT::store(m + v * W, VT::set1(-INFINITY)), VT::store(l + v * W, VT::zero());
    std::fill_n(o, a.D * NV * W, 0.0f);
    return;
  }
  // a decode tile (one row, its lanes the query heads of the KV head): keys in the vector lanes, rows copied
  const bool by_key = NV == 1 && decode_tile(t);
  const C *ksrc[kSplitKeys], *vsrc[kSplitKeys];
  row_sources(a, a.k, t, j0, j1, ksrc);
  row_sources(a, a.v, t, j0, j1, vsrc);
  key_rows(a, ksrc, n, w.kbuf.data(), w.krows.data(), by_key, vsrc, by_key ? std::min(n, kAheadRows) : 0);
  if (by_key) scores_by_key(t.lanes, w.qt.data(), a.D, w.krows.data(), n, a.scale, a.softcap, w.sc.data());
  else scores<NV>(w.qt.data(), a.D, w.krows.data(), n, j0, t, a.scale, a.softcap, w.sc.data());
  float* sc = w.sc.data();
  for (int v = 0; v < NV; ++v) {
    V mx = VT::set1(-INFINITY);
    for (int64_t j = 0; j < n; ++j) mx = VT::max(mx, VT::load(sc + (j * NV + v) * W));
    const V msafe = VT::zero_where_neg_inf(mx, mx);
    V sum = VT::zero();
    for (int64_t j = 0; j < n; ++j) {
      const V p = VT::exp(VT::sub(VT::load(sc + (j * NV + v) * W), msafe));
      VT::store(sc + (j * NV + v) * W, p);
      sum = VT::add(sum, p);
    }
    VT::store(m + v * W, mx);
    VT::store(l + v * W, sum);
  }
  key_rows(a, vsrc, n, w.vbuf.data(), w.vrows.data(), by_key, next_k, next_n);
  if (NV == 1 && t.lanes * 2 <= W) {   // a decode tile: half of the lanes or fewer in use
    pv_by_dim(sc, w.vrows.data(), n, a.D, t.lanes, o);
    return;
  }
  constexpr int kSlab = VT::kSlab / NV;
  int64_t d0 = 0;
  for (; d0 + kSlab <= a.D; d0 += kSlab) pv_slab<kSlab, NV>(sc, w.vrows.data(), n, d0, o);
  for (; d0 < a.D; d0 += 8) pv_slab<8, NV>(sc, w.vrows.data(), n, d0, o);
}

// (M, L, O) <- merge with a split's (m, l, o); NV vectors of lanes.
template <int NV>
void merge(float* M, float* L, float* O, const float* m, const float* l, const float* o, int64_t D) {
  for (int v = 0; v < NV; ++v) {
    const V Mo = VT::load(M + v * W), ms = VT::load(m + v * W), Mn = VT::max(Mo, ms);
    const V ea = VT::zero_where_neg_inf(VT::exp(VT::sub(Mo, VT::zero_where_neg_inf(Mn, Mn))), Mo);
    const V eb = VT::zero_where_neg_inf(VT::exp(VT::sub(ms, VT::zero_where_neg_inf(Mn, Mn))), ms);
    VT::store(M + v * W, Mn);
    VT::store(L + v * W, VT::add(VT::mul(VT::load(L + v * W), ea), VT::mul(VT::load(l + v * W), eb)));
    for (int64_t d = 0; d < D; ++d) {
      float *Od = O + (d * NV + v) * W;
      const float* od = o + (d * NV + v) * W;
      VT::store(Od, VT::add(VT::mul(VT::load(Od), ea), VT::mul(VT::load(od), eb)));
    }
  }
}

// The merged state to out[row, head, :] for the tile's lanes (sinks folded in first).
template <int NV, class C>
void finish(const AttnArgs<C>& a, const Tile& t, float* M, float* L, float* O, float* out) {
  for (int v = 0; v < NV; ++v) {
    V scale_o = VT::set1(1.0f), Lv = VT::load(L + v * W);
    if (a.sinks) {
      alignas(64) float sk[W];
      for (int l = 0; l < W; ++l) sk[l] = v * W + l < t.lanes ? a.sinks[t.out_head[v * W + l]] : 0.0f;
      const V sv = VT::load(sk), Mv = VT::load(M + v * W), Mn = VT::max(Mv, sv);
      scale_o = VT::zero_where_neg_inf(VT::exp(VT::sub(Mv, Mn)), Mv);
      Lv = VT::add(VT::mul(Lv, scale_o), VT::exp(VT::sub(sv, Mn)));
    }
    const V inv = VT::mul(scale_o, VT::div(VT::set1(1.0f), Lv));
    alignas(64) float col[W];
    const int64_t lanes = std::min<int64_t>(W, t.lanes - v * W);
    for (int64_t d = 0; d < a.D; ++d) {
      VT::store(col, VT::mul(VT::load(O + (d * NV + v) * W), inv));
      for (int64_t l = 0; l < lanes; ++l)
        out[(t.out_row[v * W + l] * a.H + t.out_head[v * W + l]) * a.D + d] = col[l];
    }
  }
}

template <int NV, class C>
void load_queries(const AttnArgs<C>& a, const Tile& t, float* qt) {
  std::fill_n(qt, a.D * NV * W, 0.0f);
  for (int64_t l = 0; l < t.lanes; ++l) {
    const float* q = a.q + (t.out_row[l] * a.H + t.out_head[l]) * a.D;
    for (int64_t d = 0; d < a.D; ++d) qt[(d * NV + l / W) * W + l % W] = q[d];
  }
}

// The empty merged state (M, L, O) = (-inf, 0, 0) that merge starts from, NV vectors of lanes.
template <int NV>
void init_state(float* tot, int64_t D) {
  for (int v = 0; v < NV; ++v) VT::store(tot + v * W, VT::set1(-INFINITY)), VT::store(tot + (NV + v) * W, VT::zero());
  std::fill_n(tot + 2 * NV * W, D * NV * W, 0.0f);
}

// One tile, every split in turn, merged: the output rows.
// after: the thread's next unit (tile, split), or nullptr.
template <int NV, class C>
void tile_all(const AttnArgs<C>& a, const Tile& t, int64_t first, int64_t count, Scratch& w, float* st, float* tot,
              float* out, const Tile* after, int64_t after_split) {
  const int64_t D = a.D;
  load_queries<NV>(a, t, w.qt.data());
  init_state<NV>(tot, D);
  const C* next_k[kAheadRows];
  for (int64_t s = 0; s < count; ++s) {
    const int64_t next_n = s + 1 < count ? first_keys(a, t, first + s + 1, next_k)
                           : after ? first_keys(a, *after, after_split, next_k) : 0;
    split_state<NV>(a, t, first + s, w, st, st + NV * W, st + 2 * NV * W, next_k, next_n);
    merge<NV>(tot, tot + NV * W, tot + 2 * NV * W, st, st + NV * W, st + 2 * NV * W, D);
  }
  finish<NV>(a, t, tot, tot + NV * W, tot + 2 * NV * W, out);
}

// The call: tiles over threads (dynamic: largest first); with split_items, (tile, split) items whose states are merged
// after a second pass (split items come from decode tiles only, so one vector of lanes).
template <class C>
void run(const AttnArgs<C>& a, const std::vector<Tile>& tiles, bool split_items, float* out) {
  const int64_t nt = static_cast<int64_t>(tiles.size()), D = a.D, rec = (D + 2) * W, rec_max = (D + 2) * kMaxLanes;
  std::vector<int64_t> first_split(nt), nsplit(nt), order(nt);
  for (int64_t i = 0; i < nt; ++i) {
    first_split[i] = tiles[i].key_lo / kSplitKeys;
    nsplit[i] = (tiles[i].key_hi + kSplitKeys - 1) / kSplitKeys - first_split[i];
    order[i] = i;
    if (split_items) TORCH_CHECK(tiles[i].lanes <= W, "paged_attention: split items need one vector of lanes");
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return tiles[x].key_hi - tiles[x].key_lo > tiles[y].key_hi - tiles[y].key_lo;
  });
  std::vector<int64_t> item_base(nt + 1, 0);
  for (int64_t i = 0; i < nt; ++i) item_base[i + 1] = item_base[i] + (split_items ? nsplit[i] : 1);
  const int64_t items = item_base[nt];
  std::vector<float> partial(split_items ? items * rec : 0);
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch w;
    w.reserve(D);
    std::vector<float> st(rec_max), tot(rec_max);
    const auto unit = [&](int64_t k) {   // item k's tile and (first) split
      if (!split_items) return std::pair<int64_t, int64_t>(order[k], first_split[order[k]]);
      const int64_t ti = std::upper_bound(item_base.begin(), item_base.end(), k) - item_base.begin() - 1;
      return std::pair<int64_t, int64_t>(ti, first_split[ti] + (k - item_base[ti]));
    };
    // the next item is claimed before the current one runs, so its first rows can be asked for meanwhile
    for (int64_t k = next.fetch_add(1), k2; k < items; k = k2) {
      k2 = next.fetch_add(1);
      const auto [ti, split] = unit(k);
      const auto [ti2, split2] = k2 < items ? unit(k2) : std::pair<int64_t, int64_t>(-1, 0);
      const Tile* after = ti2 >= 0 ? &tiles[ti2] : nullptr;
      if (split_items) {   // item k: a split of some tile
        float* r = partial.data() + k * rec;
        const C* next_k[kAheadRows];
        const int64_t next_n = after ? first_keys(a, *after, split2, next_k) : 0;
        load_queries<1>(a, tiles[ti], w.qt.data());
        split_state<1>(a, tiles[ti], split, w, r, r + W, r + 2 * W, next_k, next_n);
        continue;
      }
      if (tiles[ti].lanes <= W)
        tile_all<1>(a, tiles[ti], split, nsplit[ti], w, st.data(), tot.data(), out, after, split2);
      else tile_all<kMaxVecs>(a, tiles[ti], split, nsplit[ti], w, st.data(), tot.data(), out, after, split2);
    }
  });
  if (!split_items) return;
  at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tot(rec);
    for (int64_t ti = begin; ti < end; ++ti) {
      init_state<1>(tot.data(), D);
      for (int64_t k = item_base[ti]; k < item_base[ti + 1]; ++k) {
        const float* r = partial.data() + k * rec;
        merge<1>(tot.data(), tot.data() + W, tot.data() + 2 * W, r, r + W, r + 2 * W, D);
      }
      finish<1>(a, tiles[ti], tot.data(), tot.data() + W, tot.data() + 2 * W, out);
    }
  });
}

}  // namespace PAGEDSERVE_LANES_NS
