// Paged prefill attention: a step's new tokens (a prefill chunk, possibly after a prefix-cache hit) attend causally
// to their sequence's cached prefix and to themselves, reading K/V through the block table.
//
// Query row r of a sequence (0 <= r < query_len) sits at absolute position p = context_len - query_len + r and sees
// keys 0..p, or under a sliding window W > 0 keys p - W + 1 .. p (transformers' sliding_window): a tile then starts
// at the key tile holding its first row's first key, and keys before a row's window are masked. Grid: (ceil(max_query_len / BLOCK_M), num_heads, num_prefill_seqs); the m-tiles are
// visited last-first so the longest (most keys) start first. Blocks past a sequence's query_len exit at once.
//
// fp16 / bf16: FlashAttention-2 (Dao 2023) on tensor cores. Each warp owns 16 query rows; S = Q K^T and O += P V
// run on mma.m16n8k16 with fp32 accumulators; the online softmax (log2 domain) stays in registers, and the S
// accumulators are re-packed in place as the A operand of P V. K/V tiles are gathered from the paged cache with
// cp.async into XOR-swizzled shared memory (conflict-free ldmatrix), V's load overlapping S and the next K's load
// overlapping P V. fp32 has no tensor-core path here: see prefill_attention_fp32.cu.
//
// Batch invariance: a row's output depends on its query, its position and the keys only, not on the chunk it came
// in, its place in the query tile or the other sequences. The key tiles sit at absolute key positions (tile t holds
// keys [t * BLOCK_N, t * BLOCK_N + BLOCK_N)), each row folds them in key order, its reductions (the quad's max and
// sum) never mix rows, and a tile that holds no key of the row (before its window, past its position, or skipped
// for the whole warp) leaves the row's state as it was (its scores are -inf: alpha = 1, or 0 on the empty state, and
// it adds p = 0). It is not the decode kernel's arithmetic: S and P V are mma.m16n8k16 products, P rounded to T,
// over BLOCK_N-key tiles, where paged_decode_kernel folds fp32 fmas over 256-key partitions on CUDA cores; so a
// prompt's row and a decode of the same position differ in the last bits (fp32 prefill equals the decode: see
// prefill_attention_fp32.cu).
#include "common.cuh"

namespace pagedserve {

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows][HEAD_DIM] tile of 16-bit elements, with the
// chunk index XOR-swizzled by the row so 8 consecutive rows of one chunk column hit 8 different bank groups.
template <int HEAD_DIM> __device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}

// Gathers keys/values [n0, n0 + ROWS) of one KV head into a swizzled tile; rows before `kv_begin` (outside every
// row's sliding window) or at or past `kv_end` are zeroed.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int ROWS, int THREADS>
__device__ __forceinline__ void load_kv_tile(T* tile, const T* cache, const int* table, int n0, int kv_begin,
                                             int kv_end, long long row_stride, long long head_offset) {
  constexpr int kChunks = HEAD_DIM / 8;
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks, c = i % kChunks, token = n0 + r;
    const bool valid = token >= kv_begin && token < kv_end;
    long long offset = 0;
    if (valid) {
      const int phys = __ldg(table + token / BLOCK_SIZE);
      offset = ((long long)phys * BLOCK_SIZE + token % BLOCK_SIZE) * row_stride + head_offset + c * 8;
    }
    cp_async_16(tile + swizzled<HEAD_DIM>(r, c), cache + offset, valid);
  }
}

}  // namespace pagedserve

// out:             [num_tokens, num_heads, HEAD_DIM], rows out_stride elements apart.
// query:           [num_tokens, num_heads, HEAD_DIM], rows q_stride apart, head_dim contiguous.
// k_cache/v_cache: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] contiguous, already holding this step's rows.
// block_tables:    [num_seqs, max_blocks] int32, rows block_table_stride apart.
// context_lens:    [num_seqs] int32 (cached + new tokens). query_start_loc: [num_seqs + 1] int32.
// seq_offset:      index of the first prefill sequence (decodes come first). scale_log2: scale * log2(e).
// sliding_window:  0 (causal over the whole context), or W > 0.
// softcap_log2:    0, or the scores' soft-cap * log2(e) (Gemma 2: s -> c tanh(s / c) before the mask).
// sinks_log2:      nullptr, or [num_heads] fp32 sink logits * log2(e) (gpt-oss: one more denominator term).
// Dynamic shared memory: (16 * NUM_WARPS + 2 * BLOCK_N) * HEAD_DIM * sizeof(T) bytes.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int NUM_WARPS, int BLOCK_N>
__global__ void __launch_bounds__(NUM_WARPS * 32, (HEAD_DIM > 128 ? 1 : 2))
    paged_prefill_kernel(T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ k_cache,
                         const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                         const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
                         long long out_stride, long long q_stride, int block_table_stride, int num_heads,
                         int num_kv_heads, int seq_offset, float scale_log2, int sliding_window,
                         float softcap_log2, const float* __restrict__ sinks_log2) {
  using namespace pagedserve;
  constexpr int kThreads = NUM_WARPS * 32, kBlockM = 16 * NUM_WARPS;
  constexpr int kChunks = HEAD_DIM / 8, kKSteps = HEAD_DIM / 16, kNTiles = BLOCK_N / 8, kDTiles = HEAD_DIM / 8;
  constexpr bool kQInRegs = HEAD_DIM <= 128;  // at 256 the O accumulators need the registers
  static_assert(HEAD_DIM % 64 == 0 && BLOCK_N % 16 == 0, "tile shapes");

  extern __shared__ uint4 smem_u4[];
  T* s_q = reinterpret_cast<T*>(smem_u4);
  T* s_k = s_q + kBlockM * HEAD_DIM;
  T* s_v = s_k + BLOCK_N * HEAD_DIM;

  const int seq = seq_offset + blockIdx.z, head = blockIdx.y;
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;
  if (m0 >= q_len) return;
  const int prefix = context_lens[seq] - q_len;
  const int rows_here = min(kBlockM, q_len - m0);
  const int kv_end = prefix + m0 + rows_here;  // the tile's last row sees keys [0, kv_end)
  // the tile's first row sees keys from kv_begin on (0 without a window); earlier key tiles are skipped
  const int kv_begin = sliding_window > 0 ? max(0, prefix + m0 - sliding_window + 1) : 0;
  const int first_tile = kv_begin / BLOCK_N;
  const int num_tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int* table = block_tables + (long long)seq * block_table_stride;
  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;
  const long long head_offset = (long long)kv_head * HEAD_DIM;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates
  const int warp_row0 = warp * 16;        // the warp's first row in the tile
  const int pos0 = prefix + m0 + warp_row0 + g, pos1 = pos0 + 8;  // absolute positions of this lane's 2 rows

  // Q tile (rows past q_len zero-filled) in one cp.async group, the first K tile in the next.
  for (int i = threadIdx.x; i < kBlockM * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = r < rows_here;
    const T* src = query + (long long)(q_begin + m0 + (valid ? r : 0)) * q_stride + (long long)head * HEAD_DIM + c * 8;
    cp_async_16(s_q + swizzled<HEAD_DIM>(r, c), src, valid);
  }
  cp_async_commit();
  load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BLOCK_N, kThreads>(s_k, k_cache, table, first_tile * BLOCK_N, kv_begin, kv_end,
                                                           row_stride, head_offset);
  cp_async_commit();

  // ldmatrix lane roles: matrix index mi and row within it. For head_dim <= 128 each warp keeps its 16 Q rows as
  // A fragments in registers for the whole KV loop (loaded once the Q group has landed).
  const int mi = lane >> 3, mrow = lane & 7;
  unsigned int q_frag[kQInRegs ? kKSteps : 1][4];
  if constexpr (kQInRegs) {
    cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
      ldmatrix_x4(q_frag[kk], s_q + swizzled<HEAD_DIM>(warp_row0 + (mi & 1) * 8 + mrow, 2 * kk + (mi >> 1)));
  }
  float o[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m_run0 = neg_inf(), m_run1 = neg_inf(), l_run0 = 0.f, l_run1 = 0.f;

  const int warp_first_pos = prefix + m0 + warp_row0;  // positions of the warp's rows: warp_first_pos + 0..15
  for (int tile = first_tile; tile < num_tiles; ++tile) {
    const int n0 = tile * BLOCK_N;
    cp_async_wait<0>();
    __syncthreads();  // K tile (and Q) visible; every warp is done with the previous V tile
    load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BLOCK_N, kThreads>(s_v, v_cache, table, n0, kv_begin, kv_end, row_stride,
                                                             head_offset);
    cp_async_commit();
    // A warp whose rows are all padding, all before this tile's first key, or (under a window) all past its last
    // key's window, has nothing to add.
    const bool active = warp_row0 < rows_here && n0 <= warp_first_pos + 15 &&
                        (sliding_window <= 0 || n0 + BLOCK_N - 1 > warp_first_pos - sliding_window);

    float s[kNTiles][4];
    if (active) {
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        unsigned int a_reg[4];
        if constexpr (kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a_reg[r] = q_frag[kk][r];
        } else {
          ldmatrix_x4(a_reg, s_q + swizzled<HEAD_DIM>(warp_row0 + (mi & 1) * 8 + mrow, 2 * kk + (mi >> 1)));
        }
#pragma unroll
        for (int n = 0; n < kNTiles; n += 2) {
          unsigned int b[4];
          ldmatrix_x4(b, s_k + swizzled<HEAD_DIM>((n + (mi >> 1)) * 8 + mrow, 2 * kk + (mi & 1)));
          mma_16816<T>(s[n], a_reg, b[0], b[1]);
          mma_16816<T>(s[n + 1], a_reg, b[2], b[3]);
        }
      }
      // Scale into the log2 domain and apply the causal mask where the tile crosses the diagonal, and the window's
      // where its first key is before the window of the warp's last row.
      const bool need_mask = n0 + BLOCK_N - 1 > warp_first_pos ||
                             (sliding_window > 0 && n0 <= warp_first_pos + 15 - sliding_window);
      float tmax0 = neg_inf(), tmax1 = neg_inf();
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + n * 8 + 2 * t + (e & 1);
          float v = s[n][e] * scale_log2;
          if (softcap_log2 > 0.f) v = softcap_log2 * tanhf(v / softcap_log2);
          const int pos = e < 2 ? pos0 : pos1;
          if (need_mask && (key > pos || (sliding_window > 0 && key <= pos - sliding_window))) v = neg_inf();
          s[n][e] = v;
        }
        tmax0 = fmaxf(tmax0, fmaxf(s[n][0], s[n][1]));
        tmax1 = fmaxf(tmax1, fmaxf(s[n][2], s[n][3]));
      }
      tmax0 = warp_max_range<1, 4>(tmax0);
      tmax1 = warp_max_range<1, 4>(tmax1);
      const float m_new0 = fmaxf(m_run0, tmax0), m_new1 = fmaxf(m_run1, tmax1);
      // A row with no visible key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
      const float base0 = m_new0 == neg_inf() ? 0.f : m_new0, base1 = m_new1 == neg_inf() ? 0.f : m_new1;
      const float alpha0 = exp2f(m_run0 - base0), alpha1 = exp2f(m_run1 - base1);
      m_run0 = m_new0;
      m_run1 = m_new1;
      float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
        s[n][0] = exp2f(s[n][0] - base0);
        s[n][1] = exp2f(s[n][1] - base0);
        s[n][2] = exp2f(s[n][2] - base1);
        s[n][3] = exp2f(s[n][3] - base1);
        sum0 += s[n][0] + s[n][1];
        sum1 += s[n][2] + s[n][3];
      }
      l_run0 = l_run0 * alpha0 + sum0;  // per-lane partial row sums; reduced over the quad at the end
      l_run1 = l_run1 * alpha1 + sum1;
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        o[d][0] *= alpha0;
        o[d][1] *= alpha0;
        o[d][2] *= alpha1;
        o[d][3] *= alpha1;
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // V tile visible; every warp is done reading this K tile
    if (tile + 1 < num_tiles) {
      load_kv_tile<T, HEAD_DIM, BLOCK_SIZE, BLOCK_N, kThreads>(s_k, k_cache, table, n0 + BLOCK_N, kv_begin, kv_end,
                                                               row_stride, head_offset);
      cp_async_commit();
    }
    if (active) {
      // O += P V: S accumulators of n-tiles (2j, 2j+1) form the A fragment of key step j.
#pragma unroll
      for (int j = 0; j < BLOCK_N / 16; ++j) {
        unsigned int a_reg[4];
        a_reg[0] = pack2<T>(s[2 * j][0], s[2 * j][1]);
        a_reg[1] = pack2<T>(s[2 * j][2], s[2 * j][3]);
        a_reg[2] = pack2<T>(s[2 * j + 1][0], s[2 * j + 1][1]);
        a_reg[3] = pack2<T>(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
        for (int d = 0; d < kDTiles; d += 2) {
          unsigned int b[4];
          ldmatrix_x4_trans(b, s_v + swizzled<HEAD_DIM>(j * 16 + (mi & 1) * 8 + mrow, d + (mi >> 1)));
          mma_16816<T>(o[d], a_reg, b[0], b[1]);
          mma_16816<T>(o[d + 1], a_reg, b[2], b[3]);
        }
      }
    }
  }

  l_run0 = warp_sum_range<1, 4>(l_run0);
  l_run1 = warp_sum_range<1, 4>(l_run1);
  float w0 = 1.f, w1 = 1.f;   // with a sink: everything relative to M = max(m, sink), plus the sink's term
  if (sinks_log2 != nullptr) {
    const float sink = sinks_log2[head], mx0 = fmaxf(m_run0, sink), mx1 = fmaxf(m_run1, sink);
    w0 = exp2f(m_run0 - mx0);
    w1 = exp2f(m_run1 - mx1);
    l_run0 = l_run0 * w0 + exp2f(sink - mx0);
    l_run1 = l_run1 * w1 + exp2f(sink - mx1);
  }
  const float inv0 = l_run0 > 0.f ? w0 / l_run0 : 0.f, inv1 = l_run1 > 0.f ? w1 / l_run1 : 0.f;
  const int r0 = m0 + warp_row0 + g, r1 = r0 + 8;  // rows within the sequence's new tokens
  T* out_head = out + (long long)head * HEAD_DIM + 2 * t;
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) {
    if (r0 < q_len)
      *reinterpret_cast<unsigned int*>(out_head + (long long)(q_begin + r0) * out_stride + d * 8) =
          pack2<T>(o[d][0] * inv0, o[d][1] * inv0);
    if (r1 < q_len)
      *reinterpret_cast<unsigned int*>(out_head + (long long)(q_begin + r1) * out_stride + d * 8) =
          pack2<T>(o[d][2] * inv1, o[d][3] * inv1);
  }
}
