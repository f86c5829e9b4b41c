// pagedserve's CPU kernels (x86-64 AVX2 + FMA + F16C), registered as torch ops pagedserve_cpu::* in
// torch_bindings.cpp and built by kernels/cpu_build.py, which compiles every .cpp in this folder as one translation
// unit (so names in the files' anonymous namespaces must stay distinct) and hashes every file here into its cache
// key. One file per concern, after vLLM's csrc/cpu/:
//   cpu_types.hpp      vector helpers (horizontal sums, exp, dot)
//   cache_types.hpp    the KV cache's element types (float32 / float16 / bfloat16): dispatch, load, store
//   linear.hpp         formats and paths of the linears, and the register tile they share
//   linear_f32.cpp     linear_f32
//   linear_quant.cpp   linear_q4, linear_q8
//   linear_a8.hpp      int8 activations: quantization, 8-row weight panels, integer register tiles
//   linear_a8_vnni.hpp the same tile on AVX-VNNI, runtime-dispatched
//   linear_a8.cpp      linear_q4_a8, linear_q8_a8 (int8 activations), pack_a8_panels + linear_a8_packed (the
//                      same on panels packed once at load), linear_a8_vnni
//   linear_amx.cpp     linear_q4_amx (linear_q4_a8's function on AMX tiles), linear_amx_available
//   linear_vnni.cpp    pack_q4_vnni, linear_q4_vnni, pack_q8_vnni, linear_q8_vnni (int8 activations on AVX-512 VNNI,
//                      16-row panels)
//   dequant.cpp        dequantize_q4, dequantize_q8 (weights to float32 for the BLAS GEMM of long prefill chunks)
//   attention.cpp      paged_attention, paged_decode_attention (batch-invariant; body in attention_lanes.hpp, decode
//                      tiles' helpers in attention_decode.hpp)
//   cache.cpp          reshape_and_cache (KV write)
//   elementwise.cpp    rms_norm, rotary_embedding, silu_and_mul
//   decode_stack.cpp   llama_decode_layers (a decode-only step's decoder stack in one call, over the ops above)
// Shapes, dtypes and the checks each op makes are documented at its definition.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

namespace pagedserve::cpu {

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                     int64_t group_size, const c10::optional<at::Tensor>& bias);
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t group_size,
                     const c10::optional<at::Tensor>& bias);
at::Tensor linear_q4_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                        int64_t group_size, const c10::optional<at::Tensor>& bias, int64_t levels);
at::Tensor linear_q8_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t group_size,
                        const c10::optional<at::Tensor>& bias, int64_t levels);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_a8_panels(const at::Tensor& codes, const at::Tensor& scale,
                                                              const c10::optional<at::Tensor>& min,
                                                              int64_t group_size);
at::Tensor linear_a8_packed(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dw, const at::Tensor& mw,
                            int64_t N, const c10::optional<at::Tensor>& bias, int64_t levels);
bool linear_a8_vnni(int64_t mode);
at::Tensor linear_q4_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                         int64_t group_size, const c10::optional<at::Tensor>& bias, int64_t levels);
bool linear_amx_available();
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q4_vnni(const at::Tensor& codes, const at::Tensor& scale,
                                                            const at::Tensor& min, int64_t group_size);
at::Tensor linear_q4_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dw, const at::Tensor& mw,
                          int64_t N, const c10::optional<at::Tensor>& bias, int64_t levels);
std::tuple<at::Tensor, at::Tensor> pack_q8_vnni(const at::Tensor& codes, const at::Tensor& scale, int64_t group_size);
at::Tensor linear_q8_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dw, int64_t N,
                          const c10::optional<at::Tensor>& bias, int64_t levels);
bool linear_vnni_available();
at::Tensor dequantize_q4(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                         int64_t group_size);
at::Tensor dequantize_q8(const at::Tensor& codes, const at::Tensor& scale, int64_t group_size);

int64_t paged_attention_lanes();   // 16 (AVX-512F) or 8 (AVX2): the vector width paged_attention runs on
bool paged_attention_avx512(int64_t mode);   // -1 query, 0 off (the AVX2 code), 1 on where the CPU has it; -> on
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& context_lens, double scale, int64_t sliding_window = 0,
                           double softcap = 0.0, const c10::optional<at::Tensor>& sinks = c10::nullopt);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t max_splits = 0, int64_t sliding_window = 0, double softcap = 0.0,
                                  const c10::optional<at::Tensor>& sinks = c10::nullopt);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& slot_mapping);

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const c10::optional<at::Tensor>& residual);
at::Tensor rotary_embedding(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos_sin,
                            bool is_neox);
at::Tensor silu_and_mul(const at::Tensor& x);

at::Tensor llama_decode_layers(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& cos_sin,
                               at::TensorList input_norms, at::TensorList post_norms, const at::Tensor& final_norm,
                               at::TensorList packed, at::TensorList dw, at::TensorList mw,
                               const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features,
                               at::IntArrayRef levels, at::TensorList k_caches, at::TensorList v_caches,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                               double scale, at::IntArrayRef sliding_windows);

}  // namespace pagedserve::cpu
