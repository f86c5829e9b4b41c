// The model's fused elementwise layers: RMSNorm with residual add, rotary position embedding, SiLU-and-mul.
// Each matches its torch reference in service/pagedserve/ops.py, including where the reference rounds to the
// storage dtype (statistics and products are taken in fp32). VEC is the number of elements per access:
// VecTraits<T>::kVec (one 16-byte load) when the host found every row 16-byte aligned, else 1.
#include "common.cuh"

namespace pagedserve {

template <typename T, int VEC> __device__ __forceinline__ void load_row(const T* p, float (&f)[VEC]) {
  if constexpr (VEC == 1) {
    f[0] = to_float(*p);
  } else {
    static_assert(VEC == VecTraits<T>::kVec, "VEC is 1 or one 16-byte vector");
    unpack_vec<T>(*reinterpret_cast<const uint4*>(p), f);
  }
}

template <typename T, int VEC> __device__ __forceinline__ void store_row(T* p, const float (&f)[VEC]) {
  if constexpr (VEC == 1) {
    *p = from_float<T>(f[0]);
  } else {
    *reinterpret_cast<uint4*>(p) = pack_vec<T>(f);
  }
}

}  // namespace pagedserve

// RMSNorm (Zhang & Sennrich 2019; HF LlamaRMSNorm), optionally fused with the residual add. One block per row.
//   h = x (+ residual, rounded to T);  out = T(weight * (h * rsqrt(mean(h^2) + eps)));  residual_out = h.
// x, residual: [num_tokens, hidden], rows x_stride / residual_stride apart. weight: [hidden].
// out, residual_out: [num_tokens, hidden] contiguous (residual_out only written when RESIDUAL).
template <typename T, int VEC, bool RESIDUAL>
__global__ void __launch_bounds__(1024)
    rms_norm_kernel(T* __restrict__ out, T* residual_out, const T* __restrict__ x, const T* __restrict__ residual,
                    const T* __restrict__ weight, long long x_stride, long long residual_stride, int hidden,
                    float eps) {
  using namespace pagedserve;
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const int num_vecs = hidden / VEC;
  const T* x_row = x + row * x_stride;
  T* res_row = residual_out + row * hidden;

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float h[VEC];
    load_row<T, VEC>(x_row + i * VEC, h);
    if constexpr (RESIDUAL) {
      float r[VEC];
      load_row<T, VEC>(residual + row * residual_stride + i * VEC, r);
#pragma unroll
      for (int e = 0; e < VEC; ++e) h[e] = round_to<T>(h[e] + r[e]);
      store_row<T, VEC>(res_row + i * VEC, h);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum_sq = fmaf(h[e], h[e], sum_sq);
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);

  // Second pass re-reads this thread's own elements (from residual_out, written above by the same thread).
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float h[VEC], w[VEC];
    load_row<T, VEC>((RESIDUAL ? res_row : x_row) + i * VEC, h);
    load_row<T, VEC>(weight + i * VEC, w);
#pragma unroll
    for (int e = 0; e < VEC; ++e) h[e] = w[e] * (h[e] * inv_rms);
    store_row<T, VEC>(out + row * hidden + i * VEC, h);
  }
}

// Rotary position embedding (Su et al., RoFormer 2021), out of place. One block per token.
// NEOX: rotate the two halves of head_dim (GPT-NeoX, HF rotate_half); else interleaved pairs (GPT-J).
// x: [num_tokens, num_heads, head_dim], token / head strides given, head_dim contiguous.
// positions: [num_tokens] int64. cos_sin_cache: [max_position, head_dim] fp32, cos then sin.
// out: [num_tokens, num_heads, head_dim] contiguous.
template <typename T, bool NEOX>
__global__ void rotary_embedding_kernel(T* __restrict__ out, const T* __restrict__ x,
                                        const long long* __restrict__ positions,
                                        const float* __restrict__ cos_sin_cache, long long x_token_stride,
                                        long long x_head_stride, int num_heads, int head_dim) {
  using namespace pagedserve;
  const long long token = blockIdx.x;
  const int half = head_dim / 2;
  const float* cs = cos_sin_cache + positions[token] * head_dim;
  for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
    const int h = i / half, j = i % half;
    const int i1 = NEOX ? j : 2 * j, i2 = NEOX ? j + half : 2 * j + 1;
    const T* src = x + token * x_token_stride + h * x_head_stride;
    T* dst = out + (token * num_heads + h) * head_dim;
    const float x1 = to_float(src[i1]), x2 = to_float(src[i2]);
    const float c = __ldg(cs + j), s = __ldg(cs + half + j);
    dst[i1] = from_float<T>(x1 * c - x2 * s);
    dst[i2] = from_float<T>(x2 * c + x1 * s);
  }
}

// SwiGLU activation (Shazeer 2020): out = T(T(silu(gate)) * up), with gate = x[:, :d], up = x[:, d:].
// x: [num_tokens, 2 * d], rows x_stride apart. out: [num_tokens, d] contiguous. grid = (num_tokens, column blocks).
template <typename T, int VEC>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride, int d) {
  using namespace pagedserve;
  const long long row = blockIdx.x;
  const T* x_row = x + row * x_stride;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < d / VEC; i += gridDim.y * blockDim.x) {
    float gate[VEC], up[VEC];
    load_row<T, VEC>(x_row + i * VEC, gate);
    load_row<T, VEC>(x_row + d + i * VEC, up);
#pragma unroll
    for (int e = 0; e < VEC; ++e) gate[e] = round_to<T>(gate[e] / (1.f + expf(-gate[e]))) * up[e];
    store_row<T, VEC>(out + row * d + i * VEC, gate);
  }
}
