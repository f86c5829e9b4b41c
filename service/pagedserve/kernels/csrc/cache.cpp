// KV write (reshape_and_cache): rows t of key / value [T, Hkv, D] (rows may be strided, each row's Hkv * D floats
// contiguous) copied to slot slot_mapping[t] of k_cache / v_cache [blocks, block_size, Hkv, D] (rounded to the
// cache's type); slots < 0 (padding) skipped. One call per layer instead of a mask, a check and two index_copy_ calls.
#include "cache_types.hpp"
#include "ops.h"

namespace pagedserve::cpu {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat, "key, value must be float32 [T, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && is_cache_type(k_cache.scalar_type()) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
              "k_cache, v_cache must be contiguous float32, float16 or bfloat16 [blocks, block_size, kv_heads, "
              "head_dim] of one dtype");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row && k_cache.size(2) == key.size(1),
              "cache rows must hold kv_heads x head_dim of key");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || row % 8 == 0,
              "a float16 / bfloat16 cache needs kv_heads x head_dim a multiple of 8");
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "key / value rows must be contiguous within a row");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() == T && slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int64 [T]");
  const at::Tensor slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " out of range [0, ", num_slots, ")");
  const float *kp = key.data_ptr<float>(), *vp = value.data_ptr<float>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  AT_DISPATCH_SWITCH(k_cache.scalar_type(), "reshape_and_cache", PAGEDSERVE_CACHE_TYPE_CASES([&] {
    scalar_t *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      if (slots[t] < 0) continue;
      store_row(kp + t * ks, row, kc + slots[t] * row);
      store_row(vp + t * vs, row, vc + slots[t] * row);
    }
  }));
}

}  // namespace pagedserve::cpu
