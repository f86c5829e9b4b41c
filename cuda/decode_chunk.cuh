// Building blocks of paged_decode_kernel (decode_attention.cu) and paged_prefill_fp32_kernel
// (prefill_attention_fp32.cu): the fixed split-K partitions, the lane layout over K/V rows, the per-lane
// online-softmax state, staging one chunk of K/V into a warp's cp.async ring, folding a staged chunk into the softmax
// state, and the merge of partitions' partial states (decode_partition.cuh runs a whole partition).
#pragma once

#include "common.cuh"

namespace pagedserve {

// Split-K partitions at absolute key positions: partition p of a sequence holds its keys [p * 256, p * 256 + 256),
// whatever the batch, the grid, the SM count or the context capacity a CUDA graph was captured for (and the CPU
// kernels split at the same positions). kernels/geometry.py's DECODE_PARTITION mirrors it.
constexpr int kDecodePartition = 256;
constexpr int kDecodeWarps = 4;  // warps per block of paged_decode_kernel and paged_prefill_fp32_kernel

// The first key a query at position end - 1 attends to: 0, or under a sliding window W > 0 end - W (transformers'
// sliding_window: W keys counting its own).
__device__ __forceinline__ int first_key(int end, int sliding_window) {
  return sliding_window > 0 ? max(0, end - sliding_window) : 0;
}

// A partition's (or a running merge's) softmax state for one output element, in the log2 domain: m the max score,
// l = sum of exp2(s - m), o = sum of exp2(s - m) * v (unnormalised). An empty partition has m = -inf.
struct PartialState {
  float m, l, o;
};

// Folds a partition's state (pm, pl, po[]) into the running state (m, l, o[]) of N output elements of one
// row-head (m and l are per row-head), which starts at (-inf, 0, 0); partitions are folded in key order. Written with
// explicit fmaf so no contraction choice of the compiler can differ between its callers: the decode kernel (one
// partition), the merge kernel (several) and the fp32 prefill kernel (in a loop, N elements at a time) give the same
// bits for the same partition states.
template <int N>
__device__ __forceinline__ void merge_states(float& m, float& l, float (&o)[N], float pm, float pl,
                                             const float (&po)[N]) {
  if (pm == neg_inf()) return;  // no key: nothing to add
  const float mx = fmaxf(m, pm);
  const float a = exp2f(m - mx);  // 0 while the running state is empty (m = -inf)
  const float b = exp2f(pm - mx);
  l = fmaf(l, a, pl * b);
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] = fmaf(o[i], a, po[i] * b);
  m = mx;
}

// merge_states for one output element.
__device__ __forceinline__ void merge_state(PartialState& run, const PartialState& p) {
  float o[1] = {run.o};
  const float po[1] = {p.o};
  merge_states<1>(run.m, run.l, o, p.m, p.l, po);
  run.o = o[0];
}

// The output element of a merged state: o / l, with gpt-oss's sink (sinks_log2 non-null: head h's logit * log2(e))
// adding exp2(sink - M) to the denominator, everything relative to M = max(m, sink); 0 when there is no key.
__device__ __forceinline__ float finish_state(PartialState run, const float* sinks_log2, int head) {
  if (sinks_log2 != nullptr) {
    const float sink = sinks_log2[head], mx = fmaxf(run.m, sink), w = exp2f(run.m - mx);
    run.o = run.o * w;
    run.l = fmaf(run.l, w, exp2f(sink - mx));
  }
  return run.l > 0.f ? run.o / run.l : 0.f;
}

// How lanes map onto K/V rows. A row (one token, one KV head) is HEAD_DIM elements = kRowVecs 16-byte vectors;
// kLanesPerRow lanes read it (kVecsPerLane vectors each, coalesced), so a warp covers kRows tokens per step.
// kernels/geometry.py's decode_smem_bytes mirrors kSmemBytes (and PartitionSmem, decode_partition.cuh, for several
// query rows); the kernels trap if launched with less.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GQA_TILE, int NUM_WARPS>
struct DecodeLayout {
  static constexpr int kHeadDim = HEAD_DIM, kBlockSize = BLOCK_SIZE, kGqaTile = GQA_TILE, kNumWarps = NUM_WARPS;
  static constexpr int kVec = VecTraits<T>::kVec;
  static constexpr int kRowVecs = HEAD_DIM / kVec;
  static constexpr int kLanesPerRow = kRowVecs < 32 ? kRowVecs : 32;
  static constexpr int kVecsPerLane = kRowVecs / kLanesPerRow;
  static constexpr int kElems = kVecsPerLane * kVec;  // row elements owned by one lane
  static constexpr int kRows = 32 / kLanesPerRow;
  // Steps per chunk: at most 4 vectors of K (and 4 of V) per lane per stage, at most 16 scores per lane, and a
  // chunk never crosses a cache block. All factors are powers of two, so kChunk divides BLOCK_SIZE.
  static constexpr int kStepsLoads = 4 / kVecsPerLane;
  static constexpr int kStepsScores = 16 / GQA_TILE;
  static constexpr int kStepsBlock = BLOCK_SIZE / kRows;
  static constexpr int kStepsAB = kStepsLoads < kStepsScores ? kStepsLoads : kStepsScores;
  static constexpr int kSteps = kStepsAB < kStepsBlock ? kStepsAB : kStepsBlock;
  static constexpr int kChunk = kRows * kSteps;  // tokens per chunk
  static constexpr int kStages = 4;
  static constexpr int kStageVecs = kSteps * kVecsPerLane * 32;  // uint4 of K (and of V) per warp per stage
  static constexpr int kRingBytes = NUM_WARPS * kStages * 2 * kStageVecs * 16;
  static constexpr int kMergeBytes = (NUM_WARPS * GQA_TILE * HEAD_DIM + 2 * NUM_WARPS * GQA_TILE) * 4;
  static constexpr int kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;

  static_assert(HEAD_DIM % kVec == 0 && kRowVecs % kLanesPerRow == 0, "head_dim must be a multiple of 16 bytes");
  static_assert(32 % kLanesPerRow == 0, "lanes per row must divide the warp");
  static_assert(BLOCK_SIZE % kChunk == 0, "a chunk must not cross a cache block");
  static_assert(GQA_TILE >= 1 && GQA_TILE <= 8, "GQA tile of 1..8 heads");
};

// Per-lane online-softmax state for GQA_TILE heads over this lane's kElems output columns.
template <int GQA_TILE, int ELEMS> struct SoftmaxState {
  float m[GQA_TILE];             // running max (log2 domain), warp-uniform
  float l[GQA_TILE];             // running sum of exp2(score - m) over this lane's row group
  float acc[GQA_TILE][ELEMS];    // running sum of p * V over this lane's row group
};

// Stage one chunk (kChunk tokens inside one cache block) of K and V into `stage` of this warp's ring: step s,
// vector j of this lane lands at [(s * kVecsPerLane + j) * 32 + lane] (conflict-free 16-byte accesses). Tokens
// before `begin` (outside a sliding window) or at or past `end` are zero-filled. Commits a cp.async group, an empty
// one past the end so the count stays uniform.
template <typename L, typename T>
__device__ __forceinline__ void stage_chunk(uint4* stage, const T* k_cache, const T* v_cache, int chunk,
                                            long long chunk_base, int begin, int end, long long row_stride, int row,
                                            int lane) {
  if (chunk < end) {
#pragma unroll
    for (int s = 0; s < L::kSteps; ++s) {
      const int token = chunk + s * L::kRows + row;
      const bool valid = token >= begin && token < end;
      const long long base = chunk_base + (valid ? (long long)(s * L::kRows + row) * row_stride : 0);
#pragma unroll
      for (int j = 0; j < L::kVecsPerLane; ++j) {
        const int slot = (s * L::kVecsPerLane + j) * 32 + lane;
        const long long off = base + j * L::kLanesPerRow * L::kVec;
        cp_async_16(stage + slot, k_cache + off, valid);
        cp_async_16(stage + L::kStageVecs + slot, v_cache + off, valid);
      }
    }
  }
  cp_async_commit();
}

// One staged chunk into the online softmax: scores of every step's token for every head (partial dot products,
// then a butterfly over the lanes of the row), the chunk max over the warp, rescaling, and acc += p * V.
// Rows [first_valid, valid_rows) of the chunk are attended to: the query row's keys in this partition, relative to
// the chunk (valid_rows >= 1; first_valid <= 0 unless the row's first key is inside the chunk). Every operation is
// per query head, so a head's state depends on its query and the chunk's keys only. softcap_log2 > 0: each score s (log2 domain) becomes
// softcap_log2 * tanh(s / softcap_log2), Gemma 2's c * tanh(x / c) with c = softcap * log2(e).
template <typename L, typename T, int GQA_TILE>
__device__ __forceinline__ void attend_chunk(SoftmaxState<GQA_TILE, L::kElems>& st,
                                             const float (&q)[GQA_TILE][L::kElems], const uint4* stage,
                                             int first_valid, int valid_rows, int row, int lane,
                                             float softcap_log2) {
  float sc[L::kSteps][GQA_TILE];
#pragma unroll
  for (int s = 0; s < L::kSteps; ++s) {
    float kf[L::kElems];
#pragma unroll
    for (int j = 0; j < L::kVecsPerLane; ++j) {
      float f[L::kVec];
      unpack_vec<T>(stage[(s * L::kVecsPerLane + j) * 32 + lane], f);
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) kf[j * L::kVec + e] = f[e];
    }
    const int r = s * L::kRows + row;
    const bool valid = r >= first_valid && r < valid_rows;
#pragma unroll
    for (int g = 0; g < GQA_TILE; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) dot = fmaf(q[g][e], kf[e], dot);
      dot = warp_sum_range<1, L::kLanesPerRow>(dot);
      if (softcap_log2 > 0.f) dot = softcap_log2 * tanhf(dot / softcap_log2);
      sc[s][g] = valid ? dot : neg_inf();
    }
  }
#pragma unroll
  for (int g = 0; g < GQA_TILE; ++g) {
    float cmax = sc[0][g];
#pragma unroll
    for (int s = 1; s < L::kSteps; ++s) cmax = fmaxf(cmax, sc[s][g]);
    cmax = warp_max_range<L::kLanesPerRow, 32>(cmax);  // -inf only when every row is before the window
    const float m_new = fmaxf(st.m[g], cmax);
    // Nothing valid yet keeps m = -inf: subtract 0 instead so exp2 gives 0, not NaN.
    const float base = m_new == neg_inf() ? 0.f : m_new;
    const float alpha = exp2f(st.m[g] - base);  // 0 on the first chunk with a valid row (m = -inf)
    st.m[g] = m_new;
    float psum = 0.f;
#pragma unroll
    for (int s = 0; s < L::kSteps; ++s) {
      sc[s][g] = exp2f(sc[s][g] - base);  // masked tokens: exp2(-inf) = 0
      psum += sc[s][g];
    }
    st.l[g] = fmaf(st.l[g], alpha, psum);
#pragma unroll
    for (int e = 0; e < L::kElems; ++e) st.acc[g][e] *= alpha;
  }
  // Masked tokens have p = 0 and zero-filled V, so unwritten cache slots cannot inject NaN.
#pragma unroll
  for (int s = 0; s < L::kSteps; ++s) {
    float vf[L::kElems];
#pragma unroll
    for (int j = 0; j < L::kVecsPerLane; ++j) {
      float f[L::kVec];
      unpack_vec<T>(stage[L::kStageVecs + (s * L::kVecsPerLane + j) * 32 + lane], f);
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) vf[j * L::kVec + e] = f[e];
    }
#pragma unroll
    for (int g = 0; g < GQA_TILE; ++g)
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) st.acc[g][e] = fmaf(sc[s][g], vf[e], st.acc[g][e]);
  }
}

}  // namespace pagedserve
