// One split-K partition of paged attention for ROWS query rows that share a KV head: the part of
// paged_decode_kernel (decode_attention.cu, one row) and paged_prefill_fp32_kernel (prefill_attention_fp32.cu,
// several) that makes a row's partial state from the partition's keys. Being one function of the row's query, its
// key range and those keys (not of the other rows, of ROWS, of the grid or of the batch), it makes a prefill row in
// fp32 the same bits as a decode of the same position.
#pragma once

#include "decode_chunk.cuh"

namespace pagedserve {

// Dynamic shared memory of attend_partition for ROWS rows: the warps' rings, reused for the warps' states.
template <typename L, int ROWS> struct PartitionSmem {
  static constexpr int kStates = (L::kNumWarps * ROWS * L::kGqaTile * (L::kHeadDim + 2)) * 4;
  static constexpr int kBytes = L::kRingBytes > kStates ? L::kRingBytes : kStates;
};

// Row r of ROWS (each with the layout's GQA tile of query heads, q pre-scaled by scale * log2(e)) sees the keys
// [begin[r], end[r]) of this partition (none when begin[r] >= end[r]); [lo, hi) is their union, inside the partition.
// Chunks of kChunk tokens go to the warps by absolute chunk index (chunk c, tokens [c * kChunk, c * kChunk + kChunk),
// to warp c % kNumWarps), so the chunks a warp takes and their order depend on the key positions only. Each warp
// streams its chunks through its kStages-deep cp.async ring (tokens outside [lo, hi) zero-filled; kStages - 1 chunks
// in flight) and folds each into the online softmax of every row with a key in it (attend_chunk, per row: a row skips
// the chunks without its keys, exactly as the one-row launch never visits them). Then each warp's row groups are
// summed (butterfly) and its states written to shared memory for warp_partial(): s_acc [warps][ROWS * G][HEAD_DIM],
// s_max and s_sum [warps][ROWS * G]. Ends with a barrier; the caller must barrier again before the next call (which
// stages into the same memory).
template <typename L, typename T, int ROWS>
__device__ __forceinline__ void attend_partition(const float (&q)[ROWS][L::kGqaTile][L::kElems],
                                                 const int (&begin)[ROWS], const int (&end)[ROWS], int lo, int hi,
                                                 uint4* smem, const T* k_cache, const T* v_cache, const int* table,
                                                 long long row_stride, long long lane_offset, float softcap_log2) {
  constexpr int G = L::kGqaTile, kNW = L::kNumWarps, kS = L::kStages, kStride = kNW * L::kChunk;
  constexpr int kD = L::kHeadDim, kRG = ROWS * G;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = lane / L::kLanesPerRow, col = lane % L::kLanesPerRow;
  SoftmaxState<G, L::kElems> st[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      st[r].m[g] = neg_inf();
      st[r].l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) st[r].acc[g][e] = 0.f;
    }

  // Pipeline over this warp's chunks first + k * kStride: chunk k + kS - 1 is staged while chunk k is computed; each
  // chunk's block-table entry is read one iteration before it is staged (and only for chunks before hi).
  uint4* ring = smem + warp * (kS * 2 * L::kStageVecs);
  auto chunk_base = [&](int chunk, int phys) {
    return ((long long)phys * L::kBlockSize + chunk % L::kBlockSize) * row_stride + lane_offset;
  };
  auto table_entry = [&](int chunk) { return chunk < hi ? __ldg(table + chunk / L::kBlockSize) : 0; };
  const int c0 = lo / L::kChunk;  // the chunk holding lo; this warp's first chunk is the next one it owns
  const int first = (c0 + ((warp - c0 % kNW) % kNW + kNW) % kNW) * L::kChunk;
#pragma unroll
  for (int k = 0; k < kS - 1; ++k) {
    const int chunk = first + k * kStride;
    stage_chunk<L>(ring + k * 2 * L::kStageVecs, k_cache, v_cache, chunk, chunk_base(chunk, table_entry(chunk)), lo,
                   hi, row_stride, row, lane);
  }
  int ahead = first + (kS - 1) * kStride;  // the next chunk to stage, and its block-table entry
  int ahead_phys = table_entry(ahead);
  for (int k = 0, chunk = first; chunk < hi; ++k, chunk += kStride) {
    stage_chunk<L>(ring + ((k + kS - 1) % kS) * 2 * L::kStageVecs, k_cache, v_cache, ahead,
                   chunk_base(ahead, ahead_phys), lo, hi, row_stride, row, lane);
    ahead += kStride;
    ahead_phys = table_entry(ahead);
    cp_async_wait<kS - 1>();  // this lane's copies of chunk k have landed
    const uint4* stage = ring + (k % kS) * 2 * L::kStageVecs;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (begin[r] < end[r] && chunk < end[r] && chunk + L::kChunk > begin[r])
        attend_chunk<L, T, G>(st[r], q[r], stage, begin[r] - chunk, end[r] - chunk, row, lane, softcap_log2);
  }
  cp_async_wait<0>();

  // Sum the warp's row groups (same columns, different tokens), then hand the warp's states to shared memory.
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      st[r].l[g] = warp_sum_range<L::kLanesPerRow, 32>(st[r].l[g]);
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) st[r].acc[g][e] = warp_sum_range<L::kLanesPerRow, 32>(st[r].acc[g][e]);
    }
  __syncthreads();  // every warp is done with its ring: reuse it for the states
  float* s_acc = reinterpret_cast<float*>(smem);
  float* s_max = s_acc + kNW * kRG * kD;
  float* s_sum = s_max + kNW * kRG;
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int rg = warp * kRG + r * G + g;
      if (row == 0)
#pragma unroll
        for (int j = 0; j < L::kVecsPerLane; ++j)
#pragma unroll
          for (int e = 0; e < L::kVec; ++e)
            s_acc[rg * kD + (col + j * L::kLanesPerRow) * L::kVec + e] = st[r].acc[g][j * L::kVec + e];
      if (lane == 0) {
        s_max[rg] = st[r].m[g];  // -inf for a warp with no key of the row: its weight in warp_partial is 0
        s_sum[rg] = st[r].l[g];
      }
    }
  __syncthreads();
}

// The partition's state for output element d of row-head rg (= r * G + g) after attend_partition: the warps'
// states merged in warp order relative to their largest max (m = -inf: the row has no key in the partition).
template <typename L, int ROWS>
__device__ __forceinline__ PartialState warp_partial(const uint4* smem, int rg, int d) {
  constexpr int kNW = L::kNumWarps, kRG = ROWS * L::kGqaTile;
  const float* s_acc = reinterpret_cast<const float*>(smem);
  const float* s_max = s_acc + kNW * kRG * L::kHeadDim;
  const float* s_sum = s_max + kNW * kRG;
  float gmax = s_max[rg];
#pragma unroll
  for (int w = 1; w < kNW; ++w) gmax = fmaxf(gmax, s_max[w * kRG + rg]);
  PartialState p{gmax, 0.f, 0.f};
  if (gmax == neg_inf()) return p;
#pragma unroll
  for (int w = 0; w < kNW; ++w) {
    const float wt = exp2f(s_max[w * kRG + rg] - gmax);
    p.l = fmaf(s_sum[w * kRG + rg], wt, p.l);
    p.o = fmaf(s_acc[(w * kRG + rg) * L::kHeadDim + d], wt, p.o);
  }
  return p;
}

}  // namespace pagedserve
