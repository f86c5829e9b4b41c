// Paged KV cache maintenance: write a step's new K/V rows into their slots, and copy whole blocks.
//
// Cache layout per layer (see service/pagedserve/attention/base.py): [num_blocks, block_size, num_kv_heads, head_dim],
// contiguous, so the row of slot s (= block * block_size + offset) starts at element s * num_kv_heads * head_dim.
// Both kernels are dtype-agnostic byte movers: `Unit` is the copy width chosen by the host from the pointers' and
// strides' alignment (uint4 = 16 bytes when everything is 16-byte aligned, else unsigned int or unsigned short).
#include "common.cuh"

// One thread block per new token. `slot_mapping[t] < 0` marks padding: nothing is written.
//   key, value:          [num_tokens, num_kv_heads, head_dim], rows `key_stride` / `value_stride` Units apart,
//                        each row contiguous (row_units Units).
//   k_cache, v_cache:    contiguous paged caches, row_units Units per slot.
template <typename Unit>
__global__ void reshape_and_cache_kernel(const Unit* __restrict__ key, const Unit* __restrict__ value,
                                         Unit* __restrict__ k_cache, Unit* __restrict__ v_cache,
                                         const long long* __restrict__ slot_mapping, long long key_stride,
                                         long long value_stride, int row_units) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const Unit* k_src = key + token * key_stride;
  const Unit* v_src = value + token * value_stride;
  Unit* k_dst = k_cache + slot * row_units;
  Unit* v_dst = v_cache + slot * row_units;
  for (int i = threadIdx.x; i < row_units; i += blockDim.x) {
    // Issue both loads before either store so the two reads are in flight together.
    const Unit k = k_src[i];
    const Unit v = v_src[i];
    k_dst[i] = k;
    v_dst[i] = v;
  }
}

// grid = (num_layers, num_pairs). Copies block block_mapping[p][0] to block block_mapping[p][1] in every layer's
// K and V cache (copy-on-write of a shared block, vLLM's copy_blocks).
//   key_cache_ptrs, value_cache_ptrs: [num_layers] device addresses of each layer's cache.
//   block_mapping:                    [num_pairs, 2] int64 (src, dst) physical block ids.
//   block_units:                      Units per block (block_size * num_kv_heads * head_dim * elem_size / sizeof(Unit)).
template <typename Unit>
__global__ void copy_blocks_kernel(const long long* __restrict__ key_cache_ptrs,
                                   const long long* __restrict__ value_cache_ptrs,
                                   const long long* __restrict__ block_mapping, long long block_units) {
  const int layer = blockIdx.x;
  const int pair = blockIdx.y;
  const long long src = block_mapping[2 * pair];
  const long long dst = block_mapping[2 * pair + 1];
  Unit* k = reinterpret_cast<Unit*>(key_cache_ptrs[layer]);
  Unit* v = reinterpret_cast<Unit*>(value_cache_ptrs[layer]);
  const Unit* k_src = k + src * block_units;
  const Unit* v_src = v + src * block_units;
  Unit* k_dst = k + dst * block_units;
  Unit* v_dst = v + dst * block_units;
  for (long long i = threadIdx.x; i < block_units; i += blockDim.x) {
    const Unit a = k_src[i];
    const Unit b = v_src[i];
    k_dst[i] = a;
    v_dst[i] = b;
  }
}
