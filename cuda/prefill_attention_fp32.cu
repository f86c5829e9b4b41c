// Paged prefill attention in fp32 on CUDA cores: the contract of paged_prefill_kernel (prefill_attention.cu),
// which needs fp16/bf16 for its tensor-core path, computed with the decode kernel's arithmetic. Query row r of a
// sequence sits at position p = context_len - query_len + r and sees keys 0..p, or under a sliding window W > 0 keys
// p - W + 1 .. p: exactly the keys of a decode at context length p + 1.
//
// Each block takes kRows consecutive query rows of one sequence and one KV head's tile of GQA_TILE query heads, and
// runs their keys through the decode kernel's fixed split-K partitions (256 keys at absolute positions) with the
// same code (attend_partition: the same chunks to the same warps, the same per-chunk online softmax for each row,
// the same warp merge), folding the partitions' states in key order with the decode merge's merge_state and
// normalising with its finish_state. So a row's output is the same function of its query, its position and the keys
// as a decode's: the same bits as paged_decode_kernel (+ merge) for that position, whatever chunk the row came in,
// its place in the chunk or the other sequences. The kRows rows share every K/V chunk the block stages (they differ
// only in their masks). Grid: (ceil(max_query_len / kRows), num_kv_heads * head tiles, num_prefill_seqs), row tiles
// visited last-first (the longest first).
#include "decode_partition.cuh"

// Query rows per block: 8 / GQA_TILE row-heads' worth of registers at head_dim <= 128, 4 / GQA_TILE at 256 (at
// least one row). kernels/geometry.py's prefill_fp32_rows mirrors it.
template <typename L> struct PrefillFp32Rows {
  static constexpr int kRowHeads = 32 / L::kElems;
  static constexpr int value = kRowHeads / L::kGqaTile > 0 ? kRowHeads / L::kGqaTile : 1;
};

// Arguments: those of paged_prefill_kernel (prefill_attention.cu). Dynamic shared memory:
// PartitionSmem<L, kRows>::kBytes (kernels/geometry.py's decode_smem_bytes with rows = kRows).
template <int HEAD_DIM, int BLOCK_SIZE, int GQA_TILE>
__global__ void __launch_bounds__(pagedserve::kDecodeWarps * 32, 2)
    paged_prefill_fp32_kernel(float* __restrict__ out, const float* __restrict__ query,
                              const float* __restrict__ k_cache, const float* __restrict__ v_cache,
                              const int* __restrict__ block_tables, const int* __restrict__ context_lens,
                              const int* __restrict__ query_start_loc, long long out_stride, long long q_stride,
                              int block_table_stride, int num_heads, int num_kv_heads, int seq_offset,
                              float scale_log2, int sliding_window, float softcap_log2,
                              const float* __restrict__ sinks_log2) {
  using namespace pagedserve;
  using L = DecodeLayout<float, HEAD_DIM, BLOCK_SIZE, GQA_TILE, kDecodeWarps>;
  constexpr int kRows = PrefillFp32Rows<L>::value, kRG = kRows * GQA_TILE, kThreads = kDecodeWarps * 32;
  // Thread t keeps the running state of kOwn consecutive output elements of one row-head: (t / kPerRG, its row-head,
  // and columns kOwn * (t % kPerRG) on).
  constexpr int kPerRG = kThreads / kRG, kOwn = HEAD_DIM / kPerRG;
  static_assert(kThreads % kRG == 0 && HEAD_DIM % kPerRG == 0, "row-heads must split the block evenly");
  extern __shared__ uint4 smem_ring[];
  if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned int)PartitionSmem<L, kRows>::kBytes) __trap();

  const int seq = seq_offset + blockIdx.z;
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kRows;
  if (m0 >= q_len) return;
  const int prefix = context_lens[seq] - q_len;
  const int group = num_heads / num_kv_heads;
  const int tiles_per_kv_head = (group + GQA_TILE - 1) / GQA_TILE;
  const int kv_head = blockIdx.y / tiles_per_kv_head;
  const int head_base = kv_head * group + (blockIdx.y % tiles_per_kv_head) * GQA_TILE;
  const int heads_here = min(GQA_TILE, kv_head * group + group - head_base);
  const int lane = threadIdx.x & 31, col = lane % L::kLanesPerRow;

  // Each row's keys [begin, end) (none for a row past the chunk) and its pre-scaled query slices.
  int begin[kRows], end[kRows];
  float q[kRows][GQA_TILE][L::kElems];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const bool valid = m0 + r < q_len;
    end[r] = valid ? prefix + m0 + r + 1 : 0;
    begin[r] = valid ? first_key(end[r], sliding_window) : 0;
#pragma unroll
    for (int g = 0; g < GQA_TILE; ++g)
#pragma unroll
      for (int j = 0; j < L::kVecsPerLane; ++j) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (valid && g < heads_here)
          raw = ldg16(query + (long long)(q_begin + m0 + r) * q_stride + (long long)(head_base + g) * HEAD_DIM +
                      (col + j * L::kLanesPerRow) * L::kVec);
        float f[L::kVec];
        unpack_vec<float>(raw, f);
#pragma unroll
        for (int e = 0; e < L::kVec; ++e) q[r][g][j * L::kVec + e] = f[e] * scale_log2;
      }
  }
  const int tile_lo = begin[0], tile_hi = prefix + min(q_len, m0 + kRows);  // the rows' keys: [tile_lo, tile_hi)
  const int* table = block_tables + (long long)seq * block_table_stride;
  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;
  const long long lane_offset = (long long)kv_head * HEAD_DIM + col * L::kVec;

  const int my_rg = threadIdx.x / kPerRG, my_r = my_rg / GQA_TILE, my_g = my_rg % GQA_TILE;
  const int d0 = (threadIdx.x % kPerRG) * kOwn;
  float run_m = neg_inf(), run_l = 0.f, run_o[kOwn];
#pragma unroll
  for (int k = 0; k < kOwn; ++k) run_o[k] = 0.f;
  for (int part = tile_lo / kDecodePartition; part * kDecodePartition < tile_hi; ++part) {
    const int start = part * kDecodePartition, stop = start + kDecodePartition;
    int b[kRows], e[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      b[r] = max(begin[r], start);
      e[r] = min(end[r], stop);
    }
    attend_partition<L, float, kRows>(q, b, e, max(tile_lo, start), min(tile_hi, stop), smem_ring, k_cache,
                                      v_cache, table, row_stride, lane_offset, softcap_log2);
    float po[kOwn];
    PartialState p = warp_partial<L, kRows>(smem_ring, my_rg, d0);  // its m and l are the row-head's
#pragma unroll
    for (int k = 0; k < kOwn; ++k) po[k] = k == 0 ? p.o : warp_partial<L, kRows>(smem_ring, my_rg, d0 + k).o;
    merge_states<kOwn>(run_m, run_l, run_o, p.m, p.l, po);
    __syncthreads();  // every thread has read the states before the next partition stages over them
  }

  if (m0 + my_r < q_len && my_g < heads_here) {
    float* dst = out + (long long)(q_begin + m0 + my_r) * out_stride + (long long)(head_base + my_g) * HEAD_DIM + d0;
#pragma unroll
    for (int k = 0; k < kOwn; ++k)
      dst[k] = finish_state(PartialState{run_m, run_l, run_o[k]}, sinks_log2, head_base + my_g);
  }
}
