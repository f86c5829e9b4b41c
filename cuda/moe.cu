// Mixture-of-experts routing and combine: the CUDA path of service/pagedserve/models/moe.py (SparseMoeBlock.route
// and the weighted sum after the experts; vLLM's topk_softmax and moe_sum ops do the same jobs). The experts'
// matmuls stay one GEMM per expert over its tokens (cuBLAS through torch). Both kernels are deterministic: a fixed
// order of every reduction, no atomics, each row's result a function of that row alone.
#include "common.cuh"

namespace pagedserve {

// (value, expert) pairs ordered by value descending, then expert ascending: a total order, so the k-th pick is the
// best pair strictly after the (k-1)-th and no set of chosen experts needs to be kept.
__device__ __forceinline__ bool moe_before(float v, int e, float bv, int be) {
  return v > bv || (v == bv && e < be);
}

__device__ __forceinline__ void moe_warp_best(float& v, int& e) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const int oe = __shfl_xor_sync(0xffffffffu, e, offset);
    if (moe_before(ov, oe, v, e)) {
      v = ov;
      e = oe;
    }
  }
}

}  // namespace pagedserve

// Router top-k, one warp per token (HF MixtralTopKRouter / Qwen3MoeTopKRouter / GptOssTopKRouter).
//   SOFTMAX_FIRST: p = softmax(logits) over all experts in fp32, the top_k of p (renormalized to sum 1 when
//                  `renormalize`);
//   else (gpt-oss): the top_k logits, softmax over those k.
// logits: [num_tokens, num_experts] float32 contiguous (the router bias already added).
// weights: [num_tokens, top_k] float32, ids: [num_tokens, top_k] int32, in descending weight order (ties: the
// lower expert first). 1 <= top_k <= num_experts; top_k <= 64.
template <bool SOFTMAX_FIRST>
__global__ void __launch_bounds__(256)
    moe_topk_kernel(float* __restrict__ weights, int* __restrict__ ids, const float* __restrict__ logits,
                    int num_tokens, int num_experts, int top_k, int renormalize) {
  using namespace pagedserve;
  const long long token = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (token >= num_tokens) return;  // a warp's lanes share the token: the whole warp leaves together
  const float* row = logits + token * num_experts;
  float* w_out = weights + token * top_k;
  int* id_out = ids + token * top_k;

  float row_max = neg_inf();
  for (int e = lane; e < num_experts; e += 32) row_max = fmaxf(row_max, row[e]);
  row_max = warp_max_range<1, 32>(row_max);
  float denom = 0.f;
  if constexpr (SOFTMAX_FIRST) {
    for (int e = lane; e < num_experts; e += 32) denom += expf(row[e] - row_max);
    denom = warp_sum_range<1, 32>(denom);
  }

  float prev_v = -neg_inf();
  int prev_e = -1;
  float picked_sum = 0.f;
  for (int j = 0; j < top_k; ++j) {
    float best_v = neg_inf();
    int best_e = 0x7fffffff;
    for (int e = lane; e < num_experts; e += 32) {
      const float v = row[e];
      if (moe_before(prev_v, prev_e, v, e) && moe_before(v, e, best_v, best_e)) {
        best_v = v;
        best_e = e;
      }
    }
    moe_warp_best(best_v, best_e);
    prev_v = best_v;
    prev_e = best_e;
    // SOFTMAX_FIRST: the probability; else exp relative to the largest of the k (the first pick)
    const float p = SOFTMAX_FIRST ? expf(best_v - row_max) / denom : expf(best_v - row_max);
    picked_sum += p;
    if (lane == 0) {
      w_out[j] = p;
      id_out[j] = best_e;
    }
  }
  if ((!SOFTMAX_FIRST || renormalize) && lane == 0) {  // lane 0 rereads only what it wrote itself
    for (int j = 0; j < top_k; ++j) w_out[j] = w_out[j] / picked_sum;
  }
}

// The experts' weighted outputs summed into their tokens, one block per token:
//   out[t, :] = T(sum_j src[rows[t, j], :]) with j in the order `rows` gives (ascending expert id: the order
//   models/moe.py's index_add_ adds in), accumulated in fp32.
// src: [num_rows, hidden] (each row one (token, expert) pair's output, already multiplied by its weight),
// rows: [num_tokens, top_k] int32, out: [num_tokens, hidden] contiguous.
template <typename T>
__global__ void __launch_bounds__(1024)
    moe_combine_kernel(T* __restrict__ out, const T* __restrict__ src, const int* __restrict__ rows,
                       int hidden, int top_k) {
  using namespace pagedserve;
  const long long token = blockIdx.x;
  const int* r = rows + token * top_k;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < hidden; i += gridDim.y * blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) acc += to_float(src[static_cast<long long>(r[j]) * hidden + i]);
    out[token * hidden + i] = from_float<T>(acc);
  }
}
