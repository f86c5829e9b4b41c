// llama_decode_layers: a Llama decoder stack over one decode-only step in a single call. It runs, layer after layer,
// exactly the kernels the Python forward (models/llama.py with the cpu attention backend and VNNI int4 linears) calls
// one by one: rms_norm (+ residual), linear_q4_vnni (QKV), rotary_embedding (q and k together), reshape_and_cache,
// paged_decode_attention, linear_q4_vnni (O), rms_norm (+ residual), linear_q4_vnni (gate|up), silu_and_mul,
// linear_q4_vnni (down), then the final rms_norm. Same functions, same arguments, same order: the result is bit for
// bit the Python forward's. What it removes is the per-op cost around them (about a dozen Python-dispatched calls and
// twenty tensor views per layer; at one token the step is a few ms, of which that was about a quarter).
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <vector>

#include "ops.h"

namespace pagedserve::cpu {

// hidden [T, hidden] float32 (the token embeddings), positions int64 [T], cos_sin float32 [max_pos, D].
// Per layer l: input_norms[l], post_norms[l] float32 [hidden]; weights 4 * l + {0: QKV, 1: O, 2: gate|up, 3: down}
// as pack_q4_vnni panels (packed, dw, mw) with out_features and levels, biases (None or float32 [N]);
// k_caches[l], v_caches[l] [blocks, block_size, Hkv, D] (written at slot_mapping, int64 [T]).
// block_tables int32 [T, max_blocks], context_lens int32 [T] (one decode token per sequence, the new one counted).
// sliding_windows: per layer its window in tokens (0: full attention), or empty (every layer full).
// Returns the final-normed hidden states float32 [T, hidden].
at::Tensor llama_decode_layers(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& cos_sin,
                               at::TensorList input_norms, at::TensorList post_norms, const at::Tensor& final_norm,
                               at::TensorList packed, at::TensorList dw, at::TensorList mw,
                               const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features,
                               at::IntArrayRef levels, at::TensorList k_caches, at::TensorList v_caches,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                               double scale, at::IntArrayRef sliding_windows) {
  const int64_t L = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(sliding_windows.empty() || static_cast<int64_t>(sliding_windows.size()) == L,
              "sliding_windows: one per layer (0: full attention), or none");
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(post_norms.size()) == L && static_cast<int64_t>(k_caches.size()) == L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "input_norms, post_norms, k_caches and v_caches need one entry per layer");
  for (int64_t n : {static_cast<int64_t>(packed.size()), static_cast<int64_t>(dw.size()),
                    static_cast<int64_t>(mw.size()), static_cast<int64_t>(biases.size()),
                    static_cast<int64_t>(out_features.size()), static_cast<int64_t>(levels.size())})
    TORCH_CHECK(n == 4 * L, "packed, dw, mw, biases, out_features and levels need 4 entries per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "hidden must be float32 [T, hidden]");
  TORCH_CHECK(num_heads >= 1 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0,
              "num_heads must be a positive multiple of num_kv_heads");
  const int64_t T = hidden.size(0), D = cos_sin.size(1), q_size = num_heads * D, kv_size = num_kv_heads * D;
  TORCH_CHECK(block_tables.size(0) == T && context_lens.size(0) == T, "one decode token per sequence: T == S");
  auto linear = [&](const at::Tensor& x, int64_t i) {
    const c10::optional<at::Tensor> bias = biases.get(i);
    return linear_q4_vnni(x, packed[i], dw[i], mw[i], out_features[i], bias, levels[i]);
  };
  at::Tensor x = hidden.contiguous(), residual;
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(out_features[4 * l] == q_size + 2 * kv_size, "layer ", l, ": QKV out_features != (H + 2 Hkv) D");
    auto [h, sum] = rms_norm(x, input_norms[l], eps, l == 0 ? c10::optional<at::Tensor>() : residual);
    residual = l == 0 ? x : sum;
    const at::Tensor qkv = linear(h, 4 * l);
    const at::Tensor qk = rotary_embedding(
        positions, qkv.narrow(1, 0, q_size + kv_size).view({T, num_heads + num_kv_heads, D}), cos_sin, true);
    const at::Tensor k = qk.narrow(1, num_heads, num_kv_heads);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
    reshape_and_cache(k, v, k_caches[l], v_caches[l], slot_mapping);
    const at::Tensor attn = paged_decode_attention(qk.narrow(1, 0, num_heads).contiguous(), k_caches[l], v_caches[l],
                                                   block_tables, context_lens, scale, 0,
                                                   sliding_windows.empty() ? 0 : sliding_windows[l]);
    const at::Tensor o = linear(attn.view({T, q_size}), 4 * l + 1);
    auto [h2, sum2] = rms_norm(o, post_norms[l], eps, residual);
    residual = sum2;
    x = linear(silu_and_mul(linear(h2, 4 * l + 2)), 4 * l + 3);
  }
  return std::get<0>(rms_norm(x, final_norm, eps, residual));
}

}  // namespace pagedserve::cpu
