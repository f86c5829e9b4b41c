// Paged decode attention (PagedAttention, Kwon et al., SOSP 2023) with GQA tiling and split-K (Flash-Decoding).
//
// One query token per sequence attends to its whole context, read through the sequence's block table.
// Grid: (partition slots, num_kv_heads * num_head_tiles, num_seqs). A thread block owns one KV head of one sequence
// over one partition of its context, and GQA_TILE of the query heads that share that KV head, so every K/V row it
// streams from memory is used for all of those heads (GQA tile reuse).
//
// Batch invariance: the split-K partitions sit at absolute key positions (partition p holds keys [256 p, 256 p + 256),
// kDecodePartition), so their boundaries depend on nothing but the positions: not on the other sequences of the
// batch, the grid, the SM count or a CUDA graph's capacity. Slot x of a sequence is its partition first + x, first
// being the partition of its first key; slots past its last partition exit at once. Inside a partition
// (attend_partition, decode_partition.cuh) the chunks go to the warps by absolute chunk index and each warp folds
// its chunks in key order; the warps' states merge in warp order; the partitions' states merge in key order
// (merge_state, one thread per output element: no atomics anywhere). A sequence whose keys lie in one partition
// gets its output from that block; one with several, from paged_decode_merge_kernel; both end in the same
// merge_state / finish_state calls, so a sequence's output is a fixed function of its query, its context length and
// its keys and values, whatever else the launch holds. paged_prefill_fp32_kernel runs the same partitions through
// the same code, so an fp32 prefill row equals the decode of its position bit for bit.
//
// Each warp streams its chunks through a private kStages-deep ring in shared memory with cp.async (zero-filled past
// the keys), so kStages - 1 chunks are in flight while it computes one; every lane stages exactly the 16-byte
// vectors it later reads, so the ring needs cp.async.wait_group and no barriers. Loads are 16 bytes per lane and a
// row's lanes are adjacent, so each token row is read as whole 32-byte sectors. Each warp keeps an online softmax
// (Milakov & Gimelshein 2018) in fp32, in the log2 domain (the query is pre-scaled by scale * log2(e), so exp2
// replaces exp); at the end the warps merge through shared memory (reusing the ring). With several partitions each
// block writes its partition's unnormalised output with its max and sum.
//
// Sliding window (sliding_window = W > 0): the token at position ctx - 1 sees positions ctx - W .. ctx - 1 only
// (transformers' sliding_window): the partitions from the one holding ctx - W on, reading from the chunk that holds
// it (inside the window's first cache block), the keys before it masked and zero-filled.
//
// Soft-capping (softcap_log2 > 0, Gemma 2) maps each score before the softmax (attend_chunk). Attention sinks
// (sinks_log2 non-null, gpt-oss): head h's softmax denominator gets one more term exp2(sinks_log2[h] - M), a logit
// with no value row, added where the output is normalised (finish_state; the partitions' states stay sink-free).
#include "decode_partition.cuh"

namespace pagedserve {

// The partitions a query at position ctx - 1 reads: the first one, and how many (0 for an empty context).
__device__ __forceinline__ int first_partition(int ctx, int sliding_window) {
  return first_key(ctx, sliding_window) / kDecodePartition;
}
__device__ __forceinline__ int num_partitions(int ctx, int sliding_window) {
  return ctx <= 0 ? 0 : (ctx - 1) / kDecodePartition - first_partition(ctx, sliding_window) + 1;
}

}  // namespace pagedserve

// out:        [num_seqs, num_heads, HEAD_DIM], rows out_stride elements apart (written by a sequence's block when its
//             keys lie in one partition, or when its context is empty: zeros).
// part_out:   [num_seqs, num_heads, gridDim.x, HEAD_DIM] fp32, each partition's unnormalised output (written for a
//             sequence of several partitions; nullptr when gridDim.x == 1).
// part_max:   [num_seqs, num_heads, gridDim.x] fp32, each partition's max score (log2 domain).
// part_sum:   [num_seqs, num_heads, gridDim.x] fp32, each partition's sum of exp2(score - max).
// query:      [num_seqs, num_heads, HEAD_DIM], rows q_stride elements apart, head_dim contiguous.
// k_cache, v_cache: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] contiguous.
// block_tables:     [num_seqs, >= ceil(context_len / BLOCK_SIZE)] int32, rows block_table_stride apart.
// context_lens:     [num_seqs] int32. gridDim.x must be >= every sequence's num_partitions().
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
                        int block_table_stride, int num_heads, int num_kv_heads, float scale_log2,
                        int sliding_window, float softcap_log2, const float* __restrict__ sinks_log2) {
  using namespace pagedserve;
  using L = DecodeLayout<T, HEAD_DIM, BLOCK_SIZE, GQA_TILE, NUM_WARPS>;
  constexpr int kThreads = NUM_WARPS * 32;
  extern __shared__ uint4 smem_ring[];
  if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned int)L::kSmemBytes) __trap();  // host/kernel mismatch

  const int slot = blockIdx.x, num_slots = gridDim.x, seq = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  const int tiles_per_kv_head = (group + GQA_TILE - 1) / GQA_TILE;
  const int kv_head = blockIdx.y / tiles_per_kv_head;
  const int head_base = kv_head * group + (blockIdx.y % tiles_per_kv_head) * GQA_TILE;
  const int heads_here = min(GQA_TILE, kv_head * group + group - head_base);

  const int ctx = context_lens[seq];
  const int used = num_partitions(ctx, sliding_window);
  if (slot >= used) {
    // An empty context has no keys: its output is defined as zeros. Other slots past the sequence's last partition
    // write nothing; the merge kernel reads only the partitions that hold keys.
    if (ctx <= 0 && slot == 0)
      for (int i = threadIdx.x; i < heads_here * HEAD_DIM; i += kThreads)
        out[seq * out_stride + (long long)head_base * HEAD_DIM + i] = from_float<T>(0.f);
    return;
  }
  const int part_start = (first_partition(ctx, sliding_window) + slot) * kDecodePartition;
  const int lo[1] = {max(first_key(ctx, sliding_window), part_start)};
  const int hi[1] = {min(ctx, part_start + kDecodePartition)};
  const int lane = threadIdx.x & 31, col = lane % L::kLanesPerRow;

  // This lane's slice of each query head, pre-scaled. Heads past the group's end are zero (their scores are
  // computed and thrown away: arithmetic, no memory traffic).
  float q[1][GQA_TILE][L::kElems];
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
      for (int e = 0; e < L::kVec; ++e) q[0][g][j * L::kVec + e] = f[e] * scale_log2;
    }
  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;  // elements between consecutive slots
  attend_partition<L, T, 1>(q, lo, hi, lo[0], hi[0], smem_ring, k_cache, v_cache,
                            block_tables + (long long)seq * block_table_stride, row_stride,
                            (long long)kv_head * HEAD_DIM + col * L::kVec, softcap_log2);

  for (int i = threadIdx.x; i < heads_here * HEAD_DIM; i += kThreads) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM, head = head_base + g;
    const PartialState p = warp_partial<L, 1>(smem_ring, g, d);
    if (used == 1) {
      PartialState run{neg_inf(), 0.f, 0.f};
      merge_state(run, p);
      out[seq * out_stride + (long long)head * HEAD_DIM + d] = from_float<T>(finish_state(run, sinks_log2, head));
    } else {
      const long long idx = ((long long)seq * num_heads + head) * num_slots + slot;
      part_out[idx * HEAD_DIM + d] = p.o;
      if (d == 0) {
        part_max[idx] = p.m;
        part_sum[idx] = p.l;
      }
    }
  }
}

// Combines the partitions of paged_decode_kernel for sequences with keys in several (Flash-Decoding's reduction):
// one thread per output element folds the partitions' states in key order (merge_state) and normalises
// (finish_state, the sink's term included), as the decode kernel does for a single partition.
// Grid: (num_heads, num_seqs); block: HEAD_DIM threads (at most 256). num_slots: the decode kernel's gridDim.x.
// sliding_window: the decode kernel's (it says which partitions a sequence reads). sinks_log2: nullptr, or
// [num_heads] fp32 sink logits * log2(e).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(256)
    paged_decode_merge_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                              const float* __restrict__ part_max, const float* __restrict__ part_sum,
                              const int* __restrict__ context_lens, long long out_stride, int num_slots,
                              int sliding_window, const float* __restrict__ sinks_log2) {
  using namespace pagedserve;
  const int head = blockIdx.x, num_heads = gridDim.x, seq = blockIdx.y;
  const int used = min(num_slots, num_partitions(context_lens[seq], sliding_window));
  if (used <= 1) return;  // the decode kernel wrote this sequence's output (zeros for an empty context)
  const long long base = ((long long)seq * num_heads + head) * num_slots;
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    PartialState run{neg_inf(), 0.f, 0.f};
    for (int p = 0; p < used; ++p)
      merge_state(run, PartialState{part_max[base + p], part_sum[base + p], part_out[(base + p) * HEAD_DIM + d]});
    out[seq * out_stride + (long long)head * HEAD_DIM + d] = from_float<T>(finish_state(run, sinks_log2, head));
  }
}
