// The ops' schemas (namespace pagedserve_cpu, loaded by kernels/cpu_build.py) and their CPU implementations (ops.h).
#include <torch/library.h>

#include "ops.h"

using namespace pagedserve::cpu;

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int max_splits=0, int sliding_window=0, float softcap=0., Tensor? sinks=None) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor context_lens, float scale, int sliding_window=0, float softcap=0., Tensor? sinks=None) -> Tensor");
  m.def("paged_attention_lanes() -> int", &paged_attention_lanes);
  m.def("paged_attention_avx512(int mode) -> bool", &paged_attention_avx512);   // no tensors: a catch-all kernel
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_q4(Tensor x, Tensor codes, Tensor scale, Tensor min, int group_size, Tensor? bias) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor codes, Tensor scale, int group_size, Tensor? bias) -> Tensor");
  m.def("linear_q4_a8(Tensor x, Tensor codes, Tensor scale, Tensor min, int group_size, Tensor? bias, int levels) "
        "-> Tensor");
  m.def("linear_q8_a8(Tensor x, Tensor codes, Tensor scale, int group_size, Tensor? bias, int levels) -> Tensor");
  m.def("pack_a8_panels(Tensor codes, Tensor scale, Tensor? min, int group_size) -> (Tensor, Tensor, Tensor)");
  m.def("linear_a8_packed(Tensor x, Tensor packed, Tensor dw, Tensor mw, int N, Tensor? bias, int levels) -> Tensor");
  m.def("linear_a8_vnni(int mode) -> bool", &linear_a8_vnni);   // no tensors: a catch-all kernel
  m.def("linear_q4_amx(Tensor x, Tensor codes, Tensor scale, Tensor min, int group_size, Tensor? bias, int levels) "
        "-> Tensor");
  m.def("linear_amx_available() -> bool", &linear_amx_available);
  m.def("pack_q4_vnni(Tensor codes, Tensor scale, Tensor min, int group_size) -> (Tensor, Tensor, Tensor)");
  m.def("linear_q4_vnni(Tensor x, Tensor packed, Tensor dw, Tensor mw, int N, Tensor? bias, int levels) -> Tensor");
  m.def("pack_q8_vnni(Tensor codes, Tensor scale, int group_size) -> (Tensor, Tensor)");
  m.def("linear_q8_vnni(Tensor x, Tensor packed, Tensor dw, int N, Tensor? bias, int levels) -> Tensor");
  m.def("linear_vnni_available() -> bool", &linear_vnni_available);
  m.def("dequantize_q4(Tensor codes, Tensor scale, Tensor min, int group_size) -> Tensor");
  m.def("dequantize_q8(Tensor codes, Tensor scale, int group_size) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("rotary_embedding(Tensor positions, Tensor x, Tensor cos_sin, bool is_neox) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) "
        "-> ()");
  m.def("llama_decode_layers(Tensor hidden, Tensor positions, Tensor cos_sin, Tensor[] input_norms, "
        "Tensor[] post_norms, Tensor final_norm, Tensor[] packed, Tensor[] dw, Tensor[] mw, Tensor?[] biases, "
        "int[] out_features, int[] levels, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, float eps, float scale, "
        "int[] sliding_windows=[]) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_q4", &linear_q4);
  m.impl("linear_q8", &linear_q8);
  m.impl("linear_q4_a8", &linear_q4_a8);
  m.impl("linear_q8_a8", &linear_q8_a8);
  m.impl("pack_a8_panels", &pack_a8_panels);
  m.impl("linear_a8_packed", &linear_a8_packed);
  m.impl("linear_q4_amx", &linear_q4_amx);
  m.impl("pack_q4_vnni", &pack_q4_vnni);
  m.impl("linear_q4_vnni", &linear_q4_vnni);
  m.impl("pack_q8_vnni", &pack_q8_vnni);
  m.impl("linear_q8_vnni", &linear_q8_vnni);
  m.impl("dequantize_q4", &dequantize_q4);
  m.impl("dequantize_q8", &dequantize_q8);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("llama_decode_layers", &llama_decode_layers);
}
