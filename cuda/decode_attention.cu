// Paged decode attention (PagedAttention, Kwon et al., SOSP 2023) with GQA tiling and split-K (Flash-Decoding).
//
// One query token per sequence attends to its whole context, read through the sequence's block table.
// Grid: (num_partitions, num_kv_heads * num_head_tiles, num_seqs). A thread block owns one KV head of one sequence
// over one partition of its context, and GQA_TILE of the query heads that share that KV head, so every K/V row it
// streams from memory is used for all of those heads (GQA tile reuse). Warps take cache-block-aligned chunks of
// the partition in turn; each warp keeps an online softmax (Milakov & Gimelshein 2018) in fp32, in the log2 domain
// (the query is pre-scaled by scale * log2(e), so exp2 replaces exp), and the warps' partial results are merged
// through shared memory at the end. With more than one partition, each block writes its normalised partial output
// with its running max and sum, and paged_decode_merge_kernel combines them with a log-sum-exp weighting.
#include "common.cuh"

namespace pagedserve {

// How lanes map onto K/V rows. A row (one token, one KV head) is HEAD_DIM elements = kRowVecs 16-byte vectors;
// kLanesPerRow lanes read it (kVecsPerLane vectors each, coalesced), so a warp covers kRows tokens per step.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GQA_TILE>
struct DecodeLayout {
  static constexpr int kVec = VecTraits<T>::kVec;
  static constexpr int kRowVecs = HEAD_DIM / kVec;
  static constexpr int kLanesPerRow = kRowVecs < 32 ? kRowVecs : 32;
  static constexpr int kVecsPerLane = kRowVecs / kLanesPerRow;
  static constexpr int kElems = kVecsPerLane * kVec;  // row elements owned by one lane
  static constexpr int kRows = 32 / kLanesPerRow;
  // Steps per chunk: at most 4 vectors of K (and 4 of V) in flight per lane, at most 16 scores per lane, and a
  // chunk never crosses a cache block. All factors are powers of two, so kChunk divides BLOCK_SIZE.
  static constexpr int kStepsLoads = 4 / kVecsPerLane;
  static constexpr int kStepsScores = 16 / GQA_TILE;
  static constexpr int kStepsBlock = BLOCK_SIZE / kRows;
  static constexpr int kStepsAB = kStepsLoads < kStepsScores ? kStepsLoads : kStepsScores;
  static constexpr int kSteps = kStepsAB < kStepsBlock ? kStepsAB : kStepsBlock;
  static constexpr int kChunk = kRows * kSteps;  // tokens per chunk

  static_assert(HEAD_DIM % kVec == 0 && kRowVecs % kLanesPerRow == 0, "head_dim must be a multiple of 16 bytes");
  static_assert(32 % kLanesPerRow == 0, "lanes per row must divide the warp");
  static_assert(BLOCK_SIZE % kChunk == 0, "a chunk must not cross a cache block");
  static_assert(GQA_TILE >= 1 && GQA_TILE <= 8, "GQA tile of 1..8 heads");
};

}  // namespace pagedserve

// out:        [num_seqs, num_heads, HEAD_DIM], rows out_stride elements apart (written when gridDim.x == 1).
// part_out:   [num_seqs, num_heads, gridDim.x, HEAD_DIM] fp32, normalised partial outputs (gridDim.x > 1).
// part_max:   [num_seqs, num_heads, gridDim.x] fp32, each partition's max score (log2 domain).
// part_sum:   [num_seqs, num_heads, gridDim.x] fp32, each partition's sum of exp2(score - max).
// query:      [num_seqs, num_heads, HEAD_DIM], rows q_stride elements apart, head_dim contiguous.
// k_cache, v_cache: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] contiguous.
// block_tables:     [num_seqs, >= ceil(context_len / BLOCK_SIZE)] int32, rows block_table_stride apart.
// context_lens:     [num_seqs] int32.
// partition_size:   tokens per partition, a multiple of BLOCK_SIZE (>= the longest context when gridDim.x == 1).
// scale_log2:       softmax scale * log2(e).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GQA_TILE, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * 32, (GQA_TILE >= 8 ? 2 : 3))
    paged_decode_kernel(T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
                        float* __restrict__ part_sum, const T* __restrict__ query, const T* __restrict__ k_cache,
                        const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                        const int* __restrict__ context_lens, long long out_stride, long long q_stride,
                        int block_table_stride, int num_heads, int num_kv_heads, int partition_size,
                        float scale_log2) {
  using namespace pagedserve;
  using L = DecodeLayout<T, HEAD_DIM, BLOCK_SIZE, GQA_TILE>;
  constexpr int kThreads = NUM_WARPS * 32;
  constexpr int kStride = NUM_WARPS * L::kChunk;  // tokens between a warp's consecutive chunks

  __shared__ float s_acc[NUM_WARPS][GQA_TILE][HEAD_DIM];
  __shared__ float s_max[NUM_WARPS][GQA_TILE];
  __shared__ float s_sum[NUM_WARPS][GQA_TILE];

  const int part = blockIdx.x, num_parts = gridDim.x, seq = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  const int tiles_per_kv_head = (group + GQA_TILE - 1) / GQA_TILE;
  const int kv_head = blockIdx.y / tiles_per_kv_head;
  const int tile = blockIdx.y % tiles_per_kv_head;
  const int head_base = kv_head * group + tile * GQA_TILE;
  const int heads_here = min(GQA_TILE, group - tile * GQA_TILE);

  const int ctx = context_lens[seq];
  const int start = part * partition_size;
  if (start >= ctx) {
    // An empty context has no keys: the output is defined as zeros. Other empty partitions write nothing; the
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
  // computed and thrown away, which costs arithmetic but no memory traffic).
  float q[GQA_TILE][L::kElems];
#pragma unroll
  for (int g = 0; g < GQA_TILE; ++g) {
#pragma unroll
    for (int j = 0; j < L::kVecsPerLane; ++j) {
      const int vi = col + j * L::kLanesPerRow;
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (g < heads_here) raw = ldg16(query + seq * q_stride + (long long)(head_base + g) * HEAD_DIM + vi * L::kVec);
      float f[L::kVec];
      unpack_vec<T>(raw, f);
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) q[g][j * L::kVec + e] = f[e] * scale_log2;
    }
  }

  float m[GQA_TILE], l[GQA_TILE], acc[GQA_TILE][L::kElems];
#pragma unroll
  for (int g = 0; g < GQA_TILE; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < L::kElems; ++e) acc[g][e] = 0.f;
  }

  const int* table = block_tables + (long long)seq * block_table_stride;
  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;  // elements between consecutive slots
  const long long lane_offset = (long long)kv_head * HEAD_DIM + col * L::kVec;
  int chunk = start + warp * L::kChunk;
  int phys = chunk < end ? __ldg(table + chunk / BLOCK_SIZE) : 0;

  for (; chunk < end; chunk += kStride) {
    // Prefetch the next chunk's physical block id so the dependent table read is off the critical path.
    const int next = chunk + kStride;
    const int next_phys = next < end ? __ldg(table + next / BLOCK_SIZE) : 0;
    const long long chunk_base = ((long long)phys * BLOCK_SIZE + chunk % BLOCK_SIZE) * row_stride + lane_offset;

    // All of the chunk's K and V loads are issued before any is used.
    uint4 kr[L::kSteps][L::kVecsPerLane], vr[L::kSteps][L::kVecsPerLane];
#pragma unroll
    for (int s = 0; s < L::kSteps; ++s) {
      const bool valid = chunk + s * L::kRows + row < end;
      const long long base = chunk_base + (long long)(s * L::kRows + row) * row_stride;
#pragma unroll
      for (int j = 0; j < L::kVecsPerLane; ++j) {
        kr[s][j] = valid ? ldg16(k_cache + base + j * L::kLanesPerRow * L::kVec) : make_uint4(0, 0, 0, 0);
        vr[s][j] = valid ? ldg16(v_cache + base + j * L::kLanesPerRow * L::kVec) : make_uint4(0, 0, 0, 0);
      }
    }

    // Scores: partial dot products, then a butterfly over the lanes of each row.
    float sc[L::kSteps][GQA_TILE];
#pragma unroll
    for (int s = 0; s < L::kSteps; ++s) {
      float kf[L::kElems];
#pragma unroll
      for (int j = 0; j < L::kVecsPerLane; ++j) {
        float f[L::kVec];
        unpack_vec<T>(kr[s][j], f);
#pragma unroll
        for (int e = 0; e < L::kVec; ++e) kf[j * L::kVec + e] = f[e];
      }
      const bool valid = chunk + s * L::kRows + row < end;
#pragma unroll
      for (int g = 0; g < GQA_TILE; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < L::kElems; ++e) dot = fmaf(q[g][e], kf[e], dot);
        dot = warp_sum_range<1, L::kLanesPerRow>(dot);
        sc[s][g] = valid ? dot : neg_inf();
      }
    }

    // Online softmax update. The chunk's first token is always valid, so the chunk max is finite.
#pragma unroll
    for (int g = 0; g < GQA_TILE; ++g) {
      float cmax = sc[0][g];
#pragma unroll
      for (int s = 1; s < L::kSteps; ++s) cmax = fmaxf(cmax, sc[s][g]);
      cmax = warp_max_range<L::kLanesPerRow, 32>(cmax);
      const float m_new = fmaxf(m[g], cmax);
      const float alpha = exp2f(m[g] - m_new);  // 0 on the first chunk (m = -inf)
      m[g] = m_new;
      float psum = 0.f;
#pragma unroll
      for (int s = 0; s < L::kSteps; ++s) {
        sc[s][g] = exp2f(sc[s][g] - m_new);  // masked tokens: exp2(-inf) = 0
        psum += sc[s][g];
      }
      l[g] = l[g] * alpha + psum;
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) acc[g][e] *= alpha;
    }

    // acc += p * V. Masked tokens have p = 0 and V zero-filled, so unwritten slots cannot inject NaN.
#pragma unroll
    for (int s = 0; s < L::kSteps; ++s) {
      float vf[L::kElems];
#pragma unroll
      for (int j = 0; j < L::kVecsPerLane; ++j) {
        float f[L::kVec];
        unpack_vec<T>(vr[s][j], f);
#pragma unroll
        for (int e = 0; e < L::kVec; ++e) vf[j * L::kVec + e] = f[e];
      }
#pragma unroll
      for (int g = 0; g < GQA_TILE; ++g) {
#pragma unroll
        for (int e = 0; e < L::kElems; ++e) acc[g][e] = fmaf(sc[s][g], vf[e], acc[g][e]);
      }
    }
    phys = next_phys;
  }

  // Merge the warp's row groups (same columns, different tokens), then the warps through shared memory.
#pragma unroll
  for (int g = 0; g < GQA_TILE; ++g) {
    l[g] = warp_sum_range<L::kLanesPerRow, 32>(l[g]);
#pragma unroll
    for (int e = 0; e < L::kElems; ++e) acc[g][e] = warp_sum_range<L::kLanesPerRow, 32>(acc[g][e]);
  }
  if (row == 0) {
#pragma unroll
    for (int g = 0; g < GQA_TILE; ++g)
#pragma unroll
      for (int j = 0; j < L::kVecsPerLane; ++j)
#pragma unroll
        for (int e = 0; e < L::kVec; ++e)
          s_acc[warp][g][(col + j * L::kLanesPerRow) * L::kVec + e] = acc[g][j * L::kVec + e];
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GQA_TILE; ++g) {
      s_max[warp][g] = m[g];  // -inf for a warp that had no chunk: its weight below is exp2(-inf) = 0
      s_sum[warp][g] = l[g];
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < heads_here * HEAD_DIM; i += kThreads) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float gmax = s_max[0][g];  // warp 0 always owns the partition's first chunk: finite
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) gmax = fmaxf(gmax, s_max[w][g]);
    float total = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float wt = exp2f(s_max[w][g] - gmax);
      total = fmaf(s_sum[w][g], wt, total);
      o = fmaf(s_acc[w][g][d], wt, o);
    }
    const int head = head_base + g;
    if (num_parts == 1) {
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
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(256)
    paged_decode_merge_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                              const float* __restrict__ part_max, const float* __restrict__ part_sum,
                              const int* __restrict__ context_lens, long long out_stride, int num_parts,
                              int partition_size) {
  using namespace pagedserve;
  extern __shared__ float s_weight[];
  const int head = blockIdx.x, num_heads = gridDim.x, seq = blockIdx.y;
  const int ctx = context_lens[seq];
  const int used = ctx <= 0 ? 0 : min(num_parts, (ctx + partition_size - 1) / partition_size);
  const long long base = ((long long)seq * num_heads + head) * num_parts;

  float gmax = neg_inf();
  for (int p = 0; p < used; ++p) gmax = fmaxf(gmax, part_max[base + p]);
  for (int p = threadIdx.x; p < used; p += blockDim.x)
    s_weight[p] = part_sum[base + p] * exp2f(part_max[base + p] - gmax);
  __syncthreads();
  float total = 0.f;
  for (int p = 0; p < used; ++p) total += s_weight[p];
  const float inv = total > 0.f ? 1.f / total : 0.f;

  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float o = 0.f;
    for (int p = 0; p < used; ++p) o = fmaf(s_weight[p], part_out[(base + p) * HEAD_DIM + d], o);
    out[seq * out_stride + (long long)head * HEAD_DIM + d] = from_float<T>(o * inv);
  }
}
