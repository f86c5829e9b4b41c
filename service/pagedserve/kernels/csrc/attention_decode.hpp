// Decode tiles' helpers of paged_attention (attention_lanes.hpp), included inside its lanes namespace once per
// vector type (uses W and kRegs from there; no include guard). A decode tile is one query row: its lanes are the G
// query heads of one KV head, so most of a vector of head lanes is idle. Here the keys (scores) or the head dimension
// (values) go in the vector lanes instead, while each output element keeps the fma chain of the head-lane code
// (scores, pv_slab), so a decode row's bits are those of the same row in a prefill chunk.

// Elements [d0, d0 + 4) of rows r[0..7] transposed: x[k] = (r[0][d0 + k], ..., r[7][d0 + k]).
inline void transpose8x4(const float* const* r, int64_t d0, __m256* x) {
  __m256 a[4];
  for (int i = 0; i < 4; ++i)   // rows i and i + 4 in the two halves
    a[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(r[i] + d0)), _mm_loadu_ps(r[i + 4] + d0), 1);
  const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
  const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
  x[0] = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  x[1] = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  x[2] = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  x[3] = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
}

// scores<1>'s values for a one-row tile (a decode: its lanes are the query heads of one KV head, all with the tile's
// key range, so nothing in [0, n) is masked) computed with keys in the vector lanes instead: KG groups of 8 keys, their
// elements transposed in registers 4 dimensions at a time, then per head and key the same fma chain over d = 0..D-1
// from 0, fma(q[d], k[d], acc), times scale, softcapped alike, so the same bits (KG * NH independent chains hide the
// fma latency). Lanes NH..W-1 of sc get -inf as scores<1> gives unused lanes.
template <int NH>
inline void scores_by_key(const float* qt, int64_t D, const float* const* rows, int64_t n, float scale,
                          float softcap, float* sc) {
  constexpr int KG = std::max(1, std::min(4, (kRegs - 2) / (4 + NH)));   // 4 KG + NH KG + 1 registers
  constexpr int64_t kStep = 8 * KG;   // keys
  const __m256 sv = _mm256_set1_ps(scale);
  alignas(32) float col[8];
  for (int64_t j = 0; j < n; j += kStep) {
    const float* r[KG][8];
    for (int g = 0; g < KG; ++g)
      for (int i = 0; i < 8; ++i) r[g][i] = rows[std::min<int64_t>(j + 8 * g + i, n - 1)];   // past n: repeats
    __m256 acc[KG][NH];
    for (int g = 0; g < KG; ++g)
      for (int h = 0; h < NH; ++h) acc[g][h] = _mm256_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 4) {
      __m256 x[KG][4];
      for (int g = 0; g < KG; ++g) transpose8x4(r[g], d0, x[g]);
      for (int k = 0; k < 4; ++k)
        for (int h = 0; h < NH; ++h) {
          const __m256 qv = _mm256_broadcast_ss(qt + (d0 + k) * W + h);
          for (int g = 0; g < KG; ++g) acc[g][h] = _mm256_fmadd_ps(qv, x[g][k], acc[g][h]);
        }
    }
    for (int g = 0; g < KG; ++g) {
      const int64_t j8 = j + 8 * g, keys = std::min<int64_t>(8, n - j8);
      for (int h = 0; h < NH; ++h) {
        _mm256_store_ps(col, _mm256_mul_ps(acc[g][h], sv));
        for (int64_t i = 0; i < keys; ++i)
          sc[(j8 + i) * W + h] = softcap > 0.0f ? softcap * std::tanh(col[i] / softcap) : col[i];
      }
      for (int64_t i = 0; i < keys; ++i)
        for (int l = NH; l < W; ++l) sc[(j8 + i) * W + l] = -INFINITY;
    }
  }
}

// scores_by_key for a tile of `heads` lanes (1..8).
inline void scores_by_key(int64_t heads, const float* qt, int64_t D, const float* const* rows, int64_t n, float scale,
                          float softcap, float* sc) {
  switch (heads) {
    case 1: return scores_by_key<1>(qt, D, rows, n, scale, softcap, sc);
    case 2: return scores_by_key<2>(qt, D, rows, n, scale, softcap, sc);
    case 3: return scores_by_key<3>(qt, D, rows, n, scale, softcap, sc);
    case 4: return scores_by_key<4>(qt, D, rows, n, scale, softcap, sc);
    case 5: return scores_by_key<5>(qt, D, rows, n, scale, softcap, sc);
    case 6: return scores_by_key<6>(qt, D, rows, n, scale, softcap, sc);
    case 7: return scores_by_key<7>(qt, D, rows, n, scale, softcap, sc);
    default: return scores_by_key<8>(qt, D, rows, n, scale, softcap, sc);
  }
}

// pv_slab's values for a tile of one vector of lanes computed with the head dimension in the lanes instead (a decode
// tile uses few of its lanes): per lane l and d, the same fma chain over the keys in order, fma(p_j, v_j[d], acc)
// from 0, so the same bits; written to o[d * W + l] as pv_slab does. D a multiple of 8. The dimensions in chunks of
// VC vectors of 8, every lane's accumulators of a chunk in registers, so each value row is read once per chunk.
template <int NH, int VC>
inline void pv_by_dim_chunk(const float* p, const float* const* rows, int64_t n, int64_t d0, int64_t D, float* o) {
  __m256 acc[NH][VC];
  for (int l = 0; l < NH; ++l)
    for (int i = 0; i < VC; ++i) acc[l][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* r = rows[j] + d0;
    for (int l = 0; l < NH; ++l) {
      const __m256 pj = _mm256_broadcast_ss(p + j * W + l);
      for (int i = 0; i < VC; ++i) acc[l][i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(r + 8 * i), acc[l][i]);
    }
  }
  alignas(32) float col[8];
  for (int l = 0; l < NH; ++l)
    for (int i = 0; i < VC; ++i) {
      _mm256_store_ps(col, acc[l][i]);
      for (int k = 0; k < 8; ++k) o[(d0 + 8 * i + k) * W + l] = col[k];
    }
}

template <int NH>
inline void pv_by_dim(const float* p, const float* const* rows, int64_t n, int64_t D, float* o) {
  // NH * VC accumulators, VC value vectors and a broadcast p in the kRegs registers
  constexpr int VC = NH * 8 + 9 <= kRegs ? 8 : NH * 4 + 5 <= kRegs ? 4 : NH * 2 + 3 <= kRegs ? 2 : 1;
  int64_t d0 = 0;
  for (; d0 + 8 * VC <= D; d0 += 8 * VC) pv_by_dim_chunk<NH, VC>(p, rows, n, d0, D, o);
  for (; d0 < D; d0 += 8) pv_by_dim_chunk<NH, 1>(p, rows, n, d0, D, o);
}

inline void pv_by_dim(const float* p, const float* const* rows, int64_t n, int64_t D, int64_t lanes, float* o) {
  switch (lanes) {
    case 1: pv_by_dim<1>(p, rows, n, D, o); break;
    case 2: pv_by_dim<2>(p, rows, n, D, o); break;
    case 3: pv_by_dim<3>(p, rows, n, D, o); break;
    case 4: pv_by_dim<4>(p, rows, n, D, o); break;
    case 5: pv_by_dim<5>(p, rows, n, D, o); break;
    case 6: pv_by_dim<6>(p, rows, n, D, o); break;
    case 7: pv_by_dim<7>(p, rows, n, D, o); break;
    default: pv_by_dim<8>(p, rows, n, D, o); break;
  }
  for (int64_t d = 0; d < D; ++d)   // lanes past the tile's: zeros, as pv_slab leaves them (their p are 0)
    for (int64_t l = lanes; l < W; ++l) o[d * W + l] = 0.0f;
}
