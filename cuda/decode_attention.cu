// Paged decode attention (PagedAttention, Kwon et al., SOSP 2023) with GQA tiling and split-K (Flash-Decoding).
//
// One query token per sequence attends to its whole context, read through the sequence's block table.
// Grid: (num_partitions, num_kv_heads * num_head_tiles, num_seqs). A thread block owns one KV head of one sequence
// over one partition of its context, and GQA_TILE of the query heads that share that KV head, so every K/V row it
// streams from memory is used for all of those heads (GQA tile reuse).
//
// Warps take cache-block-aligned chunks of the partition in turn. Each warp streams its chunks through a private
// kStages-deep ring in shared memory with cp.async (zero-filled past the context end), so kStages - 1 chunks are
// in flight while it computes one; every lane stages exactly the 16-byte vectors it later reads, so the ring
// needs cp.async.wait_group and no barriers. Loads are 16 bytes per lane and a row's lanes are adjacent, so each
// token row is read as whole 32-byte sectors. Each warp keeps an online softmax (Milakov & Gimelshein 2018) in
// fp32, in the log2 domain (the query is pre-scaled by scale * log2(e), so exp2 replaces exp); at the end the
// warps merge through shared memory (reusing the ring). With more than one partition, each block writes its
// normalised partial output with its running max and sum, and paged_decode_merge_kernel combines them with a
// log-sum-exp weighting.
//
// Sliding window (sliding_window = W > 0): the token at position ctx - 1 sees positions ctx - W .. ctx - 1 only
// (transformers' sliding_window). The partitions then cover [lo, ctx) with lo = window_read_start(): the window's
// first token rounded down to its cache block, so chunks stay inside blocks; the tokens of [lo, ctx - W) are
// masked and zero-filled, and only the window's blocks are read.
//
// Soft-capping (softcap_log2 > 0, Gemma 2) maps each score before the softmax (attend_chunk). Attention sinks
// (sinks_log2 non-null, gpt-oss): head h's softmax denominator gets one more term exp2(sinks_log2[h] - M), a logit
// with no value row, added where the output is normalised: here with one partition, in the merge kernel otherwise
// (the partitions' own outputs and statistics stay sink-free).
#include "decode_chunk.cuh"

// out:        [num_seqs, num_heads, HEAD_DIM], rows out_stride elements apart (written when gridDim.x == 1).
// part_out:   [num_seqs, num_heads, gridDim.x, HEAD_DIM] fp32, normalised partial outputs (gridDim.x > 1).
// part_max:   [num_seqs, num_heads, gridDim.x] fp32, each partition's max score (log2 domain).
// part_sum:   [num_seqs, num_heads, gridDim.x] fp32, each partition's sum of exp2(score - max).
// query:      [num_seqs, num_heads, HEAD_DIM], rows q_stride elements apart, head_dim contiguous.
// k_cache, v_cache: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] contiguous.
// block_tables:     [num_seqs, >= ceil(context_len / BLOCK_SIZE)] int32, rows block_table_stride apart.
// context_lens:     [num_seqs] int32.
// partition_size:   tokens per partition, a multiple of BLOCK_SIZE (>= the longest context read when gridDim.x == 1).
// scale_log2:       softmax scale * log2(e).
// sliding_window:   0 (every token of the context), or W > 0 (the last W tokens).
// softcap_log2:     0 (none), or the scores' soft-cap * log2(e).
// sinks_log2:       nullptr, or [num_heads] fp32, each head's sink logit * log2(e).
// Dynamic shared memory: DecodeLayout::kSmemBytes.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GQA_TILE, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * 32, (GQA_TILE >= 8 ? 2 : 3))
    paged_decode_kernel(T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
                        float* __restrict__ part_sum, const T* __restrict__ query, const T* __restrict__ k_cache,
                        const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                        const int* __restrict__ context_lens, long long out_stride, long long q_stride,
                        int block_table_stride, int num_heads, int num_kv_heads, int partition_size,
                        float scale_log2, int sliding_window, float softcap_log2,
                        const float* __restrict__ sinks_log2) {
  using namespace pagedserve;
  using L = DecodeLayout<T, HEAD_DIM, BLOCK_SIZE, GQA_TILE, NUM_WARPS>;
  constexpr int kThreads = NUM_WARPS * 32, kS = L::kStages;
  constexpr int kStride = NUM_WARPS * L::kChunk;  // tokens between a warp's consecutive chunks
  extern __shared__ uint4 smem_ring[];
  if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned int)L::kSmemBytes) __trap();  // host/kernel mismatch

  const int part = blockIdx.x, num_parts = gridDim.x, seq = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  const int tiles_per_kv_head = (group + GQA_TILE - 1) / GQA_TILE;
  const int kv_head = blockIdx.y / tiles_per_kv_head;
  const int head_base = kv_head * group + (blockIdx.y % tiles_per_kv_head) * GQA_TILE;
  const int heads_here = min(GQA_TILE, kv_head * group + group - head_base);

  const int ctx = context_lens[seq];
  const int begin = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;  // the first token attended to
  const int start = window_read_start(ctx, sliding_window, BLOCK_SIZE) + part * partition_size;
  if (start >= ctx) {
    // An empty context has no keys: its output is defined as zeros. Other empty partitions write nothing; the
    // merge kernel reads only the partitions that hold tokens.
    if (ctx <= 0 && num_parts == 1)
      for (int i = threadIdx.x; i < heads_here * HEAD_DIM; i += kThreads)
        out[seq * out_stride + (long long)head_base * HEAD_DIM + i] = from_float<T>(0.f);
    return;
  }
  const int end = min(ctx, start + partition_size);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = lane / L::kLanesPerRow, col = lane % L::kLanesPerRow;

  // This lane's slice of each query head, pre-scaled. Heads past the group's end are zero (their scores are
  // computed and thrown away: arithmetic, no memory traffic).
  float q[GQA_TILE][L::kElems];
#pragma unroll
  for (int g = 0; g < GQA_TILE; ++g)
#pragma unroll
    for (int j = 0; j < L::kVecsPerLane; ++j) {
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (g < heads_here)
        raw = ldg16(query + seq * q_stride + (long long)(head_base + g) * HEAD_DIM +
                    (col + j * L::kLanesPerRow) * L::kVec);
      float f[L::kVec];
      unpack_vec<T>(raw, f);
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) q[g][j * L::kVec + e] = f[e] * scale_log2;
    }
  SoftmaxState<GQA_TILE, L::kElems> st;
#pragma unroll
  for (int g = 0; g < GQA_TILE; ++g) {
    st.m[g] = neg_inf();
    st.l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < L::kElems; ++e) st.acc[g][e] = 0.f;
  }

  // Pipeline over this warp's chunks start + (warp + k * NUM_WARPS) * kChunk: chunk k + kS - 1 is staged while
  // chunk k is computed; each chunk's block-table entry is read one iteration before it is staged.
  const int* table = block_tables + (long long)seq * block_table_stride;
  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;  // elements between consecutive slots
  const long long lane_offset = (long long)kv_head * HEAD_DIM + col * L::kVec;
  uint4* ring = smem_ring + warp * (kS * 2 * L::kStageVecs);
  auto chunk_base = [&](int chunk, int phys) {
    return ((long long)phys * BLOCK_SIZE + chunk % BLOCK_SIZE) * row_stride + lane_offset;
  };
  auto table_entry = [&](int chunk) { return chunk < end ? __ldg(table + chunk / BLOCK_SIZE) : 0; };
  const int first = start + warp * L::kChunk;
#pragma unroll
  for (int k = 0; k < kS - 1; ++k) {
    const int chunk = first + k * kStride;
    stage_chunk<L>(ring + k * 2 * L::kStageVecs, k_cache, v_cache, chunk, chunk_base(chunk, table_entry(chunk)),
                   begin, end, row_stride, row, lane);
  }
  int ahead = first + (kS - 1) * kStride;  // the next chunk to stage, and its block-table entry
  int ahead_phys = table_entry(ahead);
  for (int k = 0, chunk = first; chunk < end; ++k, chunk += kStride) {
    stage_chunk<L>(ring + ((k + kS - 1) % kS) * 2 * L::kStageVecs, k_cache, v_cache, ahead,
                   chunk_base(ahead, ahead_phys), begin, end, row_stride, row, lane);
    ahead += kStride;
    ahead_phys = table_entry(ahead);
    cp_async_wait<kS - 1>();  // this lane's copies of chunk k have landed
    attend_chunk<L, T, GQA_TILE>(st, q, ring + (k % kS) * 2 * L::kStageVecs, begin - chunk, end - chunk, row, lane,
                                 softcap_log2);
  }
  cp_async_wait<0>();

  // Merge the warp's row groups (same columns, different tokens), then the warps through shared memory.
#pragma unroll
  for (int g = 0; g < GQA_TILE; ++g) {
    st.l[g] = warp_sum_range<L::kLanesPerRow, 32>(st.l[g]);
#pragma unroll
    for (int e = 0; e < L::kElems; ++e) st.acc[g][e] = warp_sum_range<L::kLanesPerRow, 32>(st.acc[g][e]);
  }
  __syncthreads();  // every warp is done with its ring: reuse it for the merge
  float* s_acc = reinterpret_cast<float*>(smem_ring);      // [NUM_WARPS][GQA_TILE][HEAD_DIM]
  float* s_max = s_acc + NUM_WARPS * GQA_TILE * HEAD_DIM;  // [NUM_WARPS][GQA_TILE]
  float* s_sum = s_max + NUM_WARPS * GQA_TILE;
  if (row == 0) {
#pragma unroll
    for (int g = 0; g < GQA_TILE; ++g)
#pragma unroll
      for (int j = 0; j < L::kVecsPerLane; ++j)
#pragma unroll
        for (int e = 0; e < L::kVec; ++e)
          s_acc[(warp * GQA_TILE + g) * HEAD_DIM + (col + j * L::kLanesPerRow) * L::kVec + e] =
              st.acc[g][j * L::kVec + e];
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GQA_TILE; ++g) {
      s_max[warp * GQA_TILE + g] = st.m[g];  // -inf for a warp with no chunk: its weight below is 0
      s_sum[warp * GQA_TILE + g] = st.l[g];
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < heads_here * HEAD_DIM; i += kThreads) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float gmax = s_max[g];  // -inf only for a warp whose tokens were all before the window; some warp's is finite
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) gmax = fmaxf(gmax, s_max[w * GQA_TILE + g]);
    float total = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float wt = exp2f(s_max[w * GQA_TILE + g] - gmax);
      total = fmaf(s_sum[w * GQA_TILE + g], wt, total);
      o = fmaf(s_acc[(w * GQA_TILE + g) * HEAD_DIM + d], wt, o);
    }
    const int head = head_base + g;
    if (num_parts == 1) {
      if (sinks_log2 != nullptr) {  // the sink's term, all relative to M = max(gmax, sink)
        const float sink = sinks_log2[head], mx = fmaxf(gmax, sink), w = exp2f(gmax - mx);
        o *= w;
        total = total * w + exp2f(sink - mx);
      }
      out[seq * out_stride + (long long)head * HEAD_DIM + d] = from_float<T>(o / total);
    } else {
      const long long p = ((long long)seq * num_heads + head) * num_parts + part;
      part_out[p * HEAD_DIM + d] = o / total;
      if (d == 0) {
        part_max[p] = gmax;
        part_sum[p] = total;
      }
    }
  }
}

// Combines the partitions of paged_decode_kernel (Flash-Decoding's reduction): with M the largest partition max,
// out = sum_p w_p * o_p / sum_p w_p, w_p = sum_p * exp2(max_p - M), over the partitions that hold tokens.
// Grid: (num_heads, num_seqs); block: HEAD_DIM threads (at most 256); dynamic shared memory: num_parts floats.
// sliding_window and block_size: the decode kernel's (they say where its partitions start). sinks_log2: nullptr,
// or [num_heads] fp32 sink logits * log2(e): the denominator gets exp2(sink - M) too, M including the sink.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(256)
    paged_decode_merge_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                              const float* __restrict__ part_max, const float* __restrict__ part_sum,
                              const int* __restrict__ context_lens, long long out_stride, int num_parts,
                              int partition_size, int sliding_window, int block_size,
                              const float* __restrict__ sinks_log2) {
  using namespace pagedserve;
  extern __shared__ float s_weight[];
  const int head = blockIdx.x, num_heads = gridDim.x, seq = blockIdx.y;
  const int ctx = context_lens[seq];
  const int read = ctx - window_read_start(ctx, sliding_window, block_size);  // tokens the partitions cover
  const int used = ctx <= 0 ? 0 : min(num_parts, (read + partition_size - 1) / partition_size);
  const long long base = ((long long)seq * num_heads + head) * num_parts;

  float gmax = neg_inf();
  for (int p = 0; p < used; ++p) gmax = fmaxf(gmax, part_max[base + p]);
  const float sink = sinks_log2 != nullptr ? sinks_log2[head] : neg_inf();
  gmax = fmaxf(gmax, sink);
  for (int p = threadIdx.x; p < used; p += blockDim.x)
    s_weight[p] = part_sum[base + p] * exp2f(part_max[base + p] - gmax);
  __syncthreads();
  float total = sinks_log2 != nullptr ? exp2f(sink - gmax) : 0.f;
  for (int p = 0; p < used; ++p) total += s_weight[p];
  const float inv = total > 0.f ? 1.f / total : 0.f;

  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float o = 0.f;
    for (int p = 0; p < used; ++p) o = fmaf(s_weight[p], part_out[(base + p) * HEAD_DIM + d], o);
    out[seq * out_stride + (long long)head * HEAD_DIM + d] = from_float<T>(o * inv);
  }
}
