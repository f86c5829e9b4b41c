// Paged prefill attention in fp32 on CUDA cores: the contract of paged_prefill_kernel (prefill_attention.cu),
// which needs fp16/bf16 for its tensor-core path. Same grid: (ceil(max_query_len / 16), num_heads,
// num_prefill_seqs), m-tiles visited last-first; query row r of a sequence sits at position
// p = context_len - query_len + r and sees keys 0..p, or under a sliding window W > 0 keys p - W + 1 .. p.
#include "common.cuh"

// fp32 prefill: the same contract as paged_prefill_kernel, on CUDA cores. Each warp owns 4 query rows of a
// 16-row tile; each lane scores one key of a 32-key tile (K rows padded by one float, so conflict-free) and owns
// HEAD_DIM / 32 output columns. Dynamic shared memory: (16 * HEAD_DIM + 32 * (HEAD_DIM + 1) + 32 * HEAD_DIM) * 4.
template <int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(128)
    paged_prefill_fp32_kernel(float* __restrict__ out, const float* __restrict__ query,
                              const float* __restrict__ k_cache, const float* __restrict__ v_cache,
                              const int* __restrict__ block_tables, const int* __restrict__ context_lens,
                              const int* __restrict__ query_start_loc, long long out_stride, long long q_stride,
                              int block_table_stride, int num_heads, int num_kv_heads, int seq_offset,
                              float scale_log2, int sliding_window, float softcap_log2,
                              const float* __restrict__ sinks_log2) {
  using namespace pagedserve;
  constexpr int kRows = 4, kBlockM = 16, kBlockN = 32, kPad = HEAD_DIM + 1, kPerLane = HEAD_DIM / 32;
  extern __shared__ float4 smem_f4[];
  float* s_q = reinterpret_cast<float*>(smem_f4);
  float* s_k = s_q + kBlockM * HEAD_DIM;
  float* s_v = s_k + kBlockN * kPad;

  const int seq = seq_offset + blockIdx.z, head = blockIdx.y;
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;
  if (m0 >= q_len) return;
  const int prefix = context_lens[seq] - q_len;
  const int rows_here = min(kBlockM, q_len - m0);
  const int kv_end = prefix + m0 + rows_here;
  const int kv_begin = sliding_window > 0 ? max(0, prefix + m0 - sliding_window + 1) : 0;  // the first row's first key
  const int kv_head = head / (num_heads / num_kv_heads);
  const int* table = block_tables + (long long)seq * block_table_stride;
  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  for (int i = threadIdx.x; i < kBlockM * HEAD_DIM; i += 128) {
    const int r = i / HEAD_DIM, d = i % HEAD_DIM;
    s_q[i] = r < rows_here ? query[(long long)(q_begin + m0 + r) * q_stride + (long long)head * HEAD_DIM + d] * scale_log2
                           : 0.f;
  }
  float o[kRows][kPerLane], m_run[kRows], l_run[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m_run[r] = neg_inf();
    l_run[r] = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) o[r][e] = 0.f;
  }

  for (int n0 = kv_begin - kv_begin % kBlockN; n0 < kv_end; n0 += kBlockN) {
    __syncthreads();  // previous tile fully consumed (and s_q written, on the first pass)
    for (int i = threadIdx.x; i < kBlockN * (HEAD_DIM / 4); i += 128) {
      const int r = i / (HEAD_DIM / 4), c = (i % (HEAD_DIM / 4)) * 4, token = n0 + r;
      float4 k4 = make_float4(0.f, 0.f, 0.f, 0.f), v4 = k4;
      if (token >= kv_begin && token < kv_end) {
        const int phys = __ldg(table + token / BLOCK_SIZE);
        const long long off = ((long long)phys * BLOCK_SIZE + token % BLOCK_SIZE) * row_stride +
                              (long long)kv_head * HEAD_DIM + c;
        k4 = __ldg(reinterpret_cast<const float4*>(k_cache + off));
        v4 = __ldg(reinterpret_cast<const float4*>(v_cache + off));
      }
      s_k[r * kPad + c] = k4.x; s_k[r * kPad + c + 1] = k4.y; s_k[r * kPad + c + 2] = k4.z; s_k[r * kPad + c + 3] = k4.w;
      *reinterpret_cast<float4*>(s_v + r * HEAD_DIM + c) = v4;
    }
    __syncthreads();

    float sc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) sc[r] = 0.f;
    for (int d = 0; d < HEAD_DIM; ++d) {
      const float k = s_k[lane * kPad + d];
#pragma unroll
      for (int r = 0; r < kRows; ++r) sc[r] = fmaf(s_q[(warp * kRows + r) * HEAD_DIM + d], k, sc[r]);
    }
    if (softcap_log2 > 0.f)   // Gemma 2's soft-cap, in the log2 domain
#pragma unroll
      for (int r = 0; r < kRows; ++r) sc[r] = softcap_log2 * tanhf(sc[r] / softcap_log2);
    float p[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int pos = prefix + m0 + warp * kRows + r;
      const int key = n0 + lane;
      const float v = key <= pos && (sliding_window <= 0 || key > pos - sliding_window) ? sc[r] : neg_inf();
      const float m_new = fmaxf(m_run[r], warp_max_range<1, 32>(v));
      const float base = m_new == neg_inf() ? 0.f : m_new;
      const float alpha = exp2f(m_run[r] - base);
      p[r] = exp2f(v - base);
      l_run[r] = l_run[r] * alpha + warp_sum_range<1, 32>(p[r]);
      m_run[r] = m_new;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) o[r][e] *= alpha;
    }
    for (int j = 0; j < kBlockN; ++j) {
      float vj[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) vj[e] = s_v[j * HEAD_DIM + lane + 32 * e];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float pj = __shfl_sync(0xffffffffu, p[r], j);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) o[r][e] = fmaf(pj, vj[e], o[r][e]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = m0 + warp * kRows + r;
    if (row >= q_len) continue;
    float w = 1.f, l = l_run[r];
    if (sinks_log2 != nullptr) {   // gpt-oss's sink: one more denominator term, relative to M = max(m, sink)
      const float sink = sinks_log2[head], mx = fmaxf(m_run[r], sink);
      w = exp2f(m_run[r] - mx);
      l = l * w + exp2f(sink - mx);
    }
    const float inv = l > 0.f ? w / l : 0.f;
    float* dst = out + (long long)(q_begin + row) * out_stride + (long long)head * HEAD_DIM;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) dst[lane + 32 * e] = o[r][e] * inv;
  }
}
