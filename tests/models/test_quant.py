"""Quantized weights (issue 18): GGUF blocks kept as stored, the int4/int8 CPU kernels, and the int4 model's
quality against the dequantized fp32 model (teacher-forced perplexity and top-1, greedy chat answers)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels.cpu_build import cpu_kernel_ops
from pagedserve.models.cpu_linear import (AMX_MIN_TOKENS, DQ_MIN_TOKENS, VNNI_MAX_TOKENS, StreamingInt4Linear,
                                          StreamingInt8Linear, amx_available, vnni_available)
from pagedserve.models.quant import (Int4Linear, Int4Weight, Int8BlockWeight, Int8Linear, quantize_int4,
                                     quantize_int8_per_channel)

TEACHER_FORCED_TOKENS = 2000


def test_gguf_tensors_unpack_to_gguf_dequantization(smollm_source, llm_parts):
    """Every Q4_1 / Q8_0 tensor of the embedded GGUF, as the loader keeps it (blocks repacked, Q/K rows
    unpermuted), dequantizes bit for bit to what gguf.quants.dequantize gives (the loader's fp32 path)."""
    cfg = llm_parts[2]
    kept = smollm_source.iter_weights(cfg, torch.float32, keep_quantized=True)
    dense = smollm_source.iter_weights(cfg, torch.float32, keep_quantized=False)
    kinds = {}
    for (name_q, w), (name_d, ref) in zip(kept, dense, strict=True):
        assert name_q == name_d
        if isinstance(w, torch.Tensor):
            continue
        kinds[type(w).__name__] = kinds.get(type(w).__name__, 0) + 1
        got = w.dequantize()
        assert got.dtype == torch.float32 and torch.equal(got, ref), name_q
    assert kinds == {"Int4Weight": 210, "Int8BlockWeight": 1}


@pytest.fixture(scope="module")
def gguf_weights(smollm_source, llm_parts):
    """Two of the embedded GGUF's Q4_1 weights as the loader keeps them, read in one pass."""
    wanted = ("model.layers.0.mlp.down_proj.weight", "model.layers.3.mlp.gate_proj.weight")
    return {n: w for n, w in smollm_source.iter_weights(llm_parts[2], torch.float32, keep_quantized=True)
            if n in wanted}


def _kernel_view(w: Int4Weight) -> torch.Tensor:
    """The weights Int4Linear runs: scales rounded to bfloat16 (the kernel's), zeros exact (applied in float32)."""
    return Int4Weight(w.codes, w.scales.bfloat16().float(), w.zeros, w.group_size, w.source).dequantize()


def test_int4_kernel_layout_and_formula(gguf_weights):
    """The packed layout holds the codes (identity input, scale 1, zero 0 gives q - 8 exactly), and with the real
    scales and zeros the layer's weights are bf16((q - 8) * bf16(scale)) + zero: the kernel's product rounded
    to its bfloat16 output, the exact zero added in float32."""
    w = gguf_weights["model.layers.0.mlp.down_proj.weight"]
    n, k = w.codes.shape
    eye = torch.eye(k, dtype=torch.bfloat16)
    unit = Int4Linear(Int4Weight(w.codes, torch.ones_like(w.scales), torch.zeros_like(w.zeros), 32, "t"))
    assert torch.equal(unit(eye).t().float(), w.codes.float() - 8)
    layer = Int4Linear(w)
    g = w.group_size
    scaled = ((w.codes.float() - 8) * w.scales.bfloat16().float().repeat_interleave(g, 1)).bfloat16().float()
    assert torch.equal(layer(eye.float()).t(), scaled + w.zeros.repeat_interleave(g, 1))


def _rounding_bound(x, w, w_kernel, y_ref):
    """|error| of a bf16-activation weight-only matmul: the weights' own rounding, plus 2^-8 relative on the
    products (x rounded to bfloat16) and on the output (rounded to bfloat16), plus float32 accumulation."""
    return (x.abs() @ (w_kernel - w).abs().t() + 2 ** -8 * (x.abs() @ w.abs().t()) + 2 ** -8 * y_ref.abs()
            + 1e-6)


@pytest.mark.parametrize("m", [1, 7, 64])
def test_quantized_linear_matches_dequantized_fp32_linear(gguf_weights, m):
    """Int4Linear (Q4_1 as stored) and Int8Linear against F.linear with the dequantized fp32 weight, within the
    kernel's rounding; the error is also small in absolute terms."""
    gen = torch.Generator().manual_seed(m)
    w = gguf_weights["model.layers.3.mlp.gate_proj.weight"]
    x = torch.randn(m, w.codes.shape[1], generator=gen)
    dense = w.dequantize()
    ref = torch.nn.functional.linear(x, dense)
    got = Int4Linear(w)(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert ((got - ref).abs() <= _rounding_bound(x, dense, _kernel_view(w), ref)).all()
    q8 = quantize_int8_per_channel(dense)
    dense8 = q8.dequantize()
    ref8 = torch.nn.functional.linear(x, dense8)
    got8 = Int8Linear(q8)(x)
    kernel8 = q8.codes.float() * q8.scales.bfloat16().float()[:, None]
    assert ((got8 - ref8).abs() <= _rounding_bound(x, dense8, kernel8, ref8)).all()


def test_quantize_at_load_round_trip():
    """HF weights quantized at load: int4 per group and int8 per channel are within half a step of the input."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    for g in (32, 64, 128):
        q = quantize_int4(w, g)
        step = q.scales.repeat_interleave(g, 1)
        assert ((q.dequantize() - w).abs() <= step * 0.5001).all()
    q8 = quantize_int8_per_channel(w)
    assert ((q8.dequantize() - w).abs() <= q8.scales[:, None] * 0.5001).all()
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(w[:, :48], 32)


def test_q8_embedding_rows_exact(llm_int4, llm_parts):
    """The Q8_0 embedding kept as stored gives exactly the dequantized fp32 model's rows."""
    ids = torch.tensor([0, 1, 17, 1000, 49151])
    assert isinstance(llm_int4.embed_tokens.weight_blocks(), Int8BlockWeight)
    int4_layers = (Int4Linear, StreamingInt4Linear)
    assert all(isinstance(layer.self_attn.qkv_proj, int4_layers) and layer.self_attn.qkv_proj.source == "Q4_1"
               for layer in llm_int4.layers)
    assert torch.equal(llm_int4.embed_tokens(ids), llm_parts[0].embed_tokens(ids))


def _fixed_text_ids(tokenizer) -> list[int]:
    """A fixed English text: Python 3.11's bundled documentation topics (pydoc_data), grammar lines dropped."""
    from pydoc_data.topics import topics

    text = "\n".join(line for key in sorted(topics) for line in topics[key].splitlines() if "::=" not in line)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > TEACHER_FORCED_TOKENS
    return ids[:TEACHER_FORCED_TOKENS]


@torch.inference_mode()
def _teacher_forced(model, ids: list[int], backend=None, kv_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 predictions ``[T-1]``, next-token NLL ``[T-1]``) of one prefill over ``ids`` (torch attention unless
    ``backend``; a float32 KV cache unless ``kv_dtype``)."""
    from support import prefill_hidden

    T = len(ids)
    hidden = prefill_hidden(model, ids, backend, kv_dtype)[:-1]
    targets = torch.tensor(ids[1:])
    top1, nll = [], []
    for s in range(0, T - 1, 256):
        logits = model.compute_logits(hidden[s:s + 256])
        top1.append(logits.argmax(-1))
        nll.append(-torch.log_softmax(logits, -1).gather(1, targets[s:s + 256, None])[:, 0])
    return torch.cat(top1), torch.cat(nll)


@pytest.mark.parametrize("path", ["as built", "served", "int8 x2", "dq gemm", "vnni x2"])
def test_int4_teacher_forced_top1_and_perplexity(llm_int4, llm_parts, path):
    """2,000 tokens of a fixed text: top-1 agrees with the dequantized fp32 model on >= 99% of positions and the
    perplexity is within 1%. One prefill: "as built" the defaults (two-level int8 activations at every call: the
    VNNI panels where the CPU has AVX-512 VNNI, AMX tiles from 16 tokens where it has AMX-INT8, else the AVX2
    panels); "served" the same through the attention backend an engine selects for it (the cpu backend: the
    batch-invariant float32 paged-attention kernel for every row) and its KV cache (auto: float16 for a GGUF
    model); "int8 x2" the AVX2/AVX-VNNI panels alone (AMX and VNNI off); "dq gemm" the float32 GEMM of the decoded
    weights from 64 tokens (no choice takes it now: the baseline); "vnni x2" the VNNI panels alone."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.models.cpu_linear import (DQ_MIN_TOKENS, use_amx, use_dequantized_gemm, use_vnni,
                                              vnni_available)

    model, tokenizer, cfg = llm_parts
    ids = _fixed_text_ids(tokenizer)
    if path != "as built" and not llm_int4.a8_min_tokens:
        pytest.skip("the own CPU kernels did not load: no int8 activations, no GEMM path")
    if path == "vnni x2" and not vnni_available():
        pytest.skip("the CPU lacks AVX-512 VNNI")
    backend = kv_dtype = None
    if path == "served":   # and its KV cache: float16 for a GGUF model (auto)
        engine, info = build_engine(EngineConfig(device="cpu", num_kv_blocks=8), model=llm_int4, tokenizer=tokenizer,
                                    hf_config=cfg)
        backend, kv_dtype = engine.executor.worker.runner.backend, engine.executor.worker.kv_dtype
        assert kv_dtype == torch.float16 and info.kv_cache_dtype == "float16"
        assert info.prefill_attention_dtype is None and info.batch_invariant
        assert info.kernels.startswith("linears: int8 activations x2") and "batch-invariant" in info.kernels
    use_amx(llm_int4, llm_int4.amx_min_tokens if path in ("as built", "served") else 0)
    use_dequantized_gemm(llm_int4, DQ_MIN_TOKENS if path == "dq gemm" else 0)
    use_vnni(llm_int4, {"as built": llm_int4.vnni_max_tokens, "served": llm_int4.vnni_max_tokens,
                        "vnni x2": 1 << 20}.get(path, 0))
    try:
        top_q, nll_q = _teacher_forced(llm_int4, ids, backend, kv_dtype)
    finally:
        use_amx(llm_int4, llm_int4.amx_min_tokens)
        use_dequantized_gemm(llm_int4, llm_int4.dq_min_tokens)
        use_vnni(llm_int4, llm_int4.vnni_max_tokens)
    top_f, nll_f = _teacher_forced(model, ids)
    agree = (top_q == top_f).float().mean().item()
    ppl_q, ppl_f = nll_q.mean().exp().item(), nll_f.mean().exp().item()
    print(f"\nteacher-forced {len(ids)} tokens ({path}): top-1 agreement {agree:.4f}, perplexity int4 {ppl_q:.3f} "
          f"fp32 {ppl_f:.3f} ({ppl_q / ppl_f - 1:+.2%})")
    assert agree >= 0.99
    assert abs(ppl_q / ppl_f - 1) <= 0.01


def test_int4_greedy_chat_answers(llm_int4, llm_parts):
    """The end-to-end chat prompts, greedy: the int4 model's first 8 tokens equal fp32's on most prompts."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.sampling_params import SamplingParams
    from support import run_to_completion
    from support import CHAT_PROMPTS, chat_ids

    model, tokenizer, cfg = llm_parts
    outs, infos = [], []
    for m in (llm_int4, model):
        engine, info = build_engine(EngineConfig(device="cpu", attention_backend="torch", num_kv_blocks=64),
                                    model=m, tokenizer=tokenizer, hf_config=cfg)
        infos.append(info.quantization)  # what GetModelInfo reports
        for i, p in enumerate(CHAT_PROMPTS):
            engine.add_request(f"r{i}", chat_ids(tokenizer, p), SamplingParams(max_tokens=8, temperature=0.0))
        done = run_to_completion(engine)
        outs.append([done[f"r{i}"][0][0] for i in range(len(CHAT_PROMPTS))])
    assert infos[1] == "none" and infos[0].startswith("gguf: ")
    assert "120 linear int4-g32 (Q4_1 as stored)" in infos[0] and "embedding Q8_0 (as stored)" in infos[0]
    same = [a == b for a, b in zip(*outs)]
    for p, a, b in zip(CHAT_PROMPTS, *outs):
        print(f"\n{p!r}\n  int4: {tokenizer.decode(a)!r}\n  fp32: {tokenizer.decode(b)!r}")
    print(f"\nfirst 8 tokens equal on {sum(same)}/{len(same)} prompts")
    assert sum(same) > len(same) // 2


_RSS_SCRIPT = """
import json, sys, torch
from pagedserve.models.loader import ModelSource
from pagedserve.models.registry import build_model
import gguf, transformers, tqdm.auto
src = ModelSource.resolve(None); cfg = src.load_config()
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
model = build_model(src, cfg, torch.float32, "cpu", quantization=sys.argv[1], linear_kernels=sys.argv[2])
print(json.dumps({"rss_bytes": rss() - before, "quantization": model.quantization,
                  "vnni": getattr(model, "vnni_max_tokens", 0)}))
"""


def test_weight_memory_at_most_40_percent_of_fp32():
    """RSS grown by loading the model (fresh processes, libraries imported first): int4 as stored <= 40% of fp32's
    ("float-activations": no second copy); the defaults, which on an AVX-512 VNNI CPU add the int4 layers' decode
    panels (a repacked copy of their codes and scales, cpu_linear.use_vnni), <= 50%."""
    runs = {}
    for q, kernels in (("none", "auto"), ("auto", "float-activations"), ("auto", "auto")):  # at once: RSS is per process
        runs[q, kernels] = subprocess.Popen([sys.executable, "-c", _RSS_SCRIPT, q, kernels], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)
    got = {}
    for key, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-2000:]
        got[key] = json.loads(stdout.strip().splitlines()[-1])
    fp32 = got["none", "auto"]["rss_bytes"]
    stored, default = got["auto", "float-activations"], got["auto", "auto"]
    print(f"\nRSS after load: fp32 {fp32 / 2**20:.0f} MiB, {stored['quantization']}: "
          f"{stored['rss_bytes'] / 2**20:.0f} MiB ({stored['rss_bytes'] / fp32:.2f}x); with the defaults (VNNI "
          f"panels {'on' if default['vnni'] else 'off'}): {default['rss_bytes'] / 2**20:.0f} MiB "
          f"({default['rss_bytes'] / fp32:.2f}x)")
    assert stored["vnni"] == 0 and stored["rss_bytes"] / fp32 <= 0.40
    assert default["rss_bytes"] / fp32 <= (0.50 if default["vnni"] else 0.40)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    """A random Qwen2 (QKV bias, untied LM head) saved as an HF safetensors checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kernels", ["auto", "int8-activations", "float-activations", "torch"])
@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int4", 64), ("int8", 32)])
def test_hf_checkpoint_quantized_at_load(tiny_qwen2_dir, scheme, group, kernels):
    """An HF checkpoint: auto stays unquantized; int4 (group 32/64) and int8 build quantized linears (fused QKV
    with its bias, gate/up) and an int8 LM head, and the logits stay close to the fp32 model's."""
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    src = ModelSource.resolve(tiny_qwen2_dir)
    cfg = src.load_config()
    ref_model = build_model(src, cfg, torch.float32, "cpu", quantization="auto")
    assert ref_model.quantization == "none"
    model = build_model(src, cfg, torch.float32, "cpu", quantization=scheme, quant_group_size=group,
                        linear_kernels=kernels)
    own = model.linear_kernels == "pagedserve-cpu"
    assert own == (kernels != "torch" and cpu_kernel_ops() is not None)
    levels = {"auto": 2, "int8-activations": 1}.get(kernels, 0) if own else 0   # int8 activations at every call
    assert (model.a8_levels, model.a8_min_tokens) == (levels, 1 if levels else 0)
    assert model.dq_min_tokens == 0 and model.batch_invariant == own   # no choice takes the GEMM path
    amx = own and scheme == "int4" and kernels in ("auto", "int8-activations") and amx_available()
    assert model.amx_min_tokens == (AMX_MIN_TOKENS if amx else 0)
    vnni = own and kernels in ("auto", "int8-activations") and vnni_available()   # int4 and int8 layers alike
    assert model.vnni_max_tokens == (VNNI_MAX_TOKENS if vnni else 0)
    panels = "vnni_panels" if scheme == "int4" else "q8_vnni_panels"
    assert (getattr(model.layers[0].mlp.down_proj, panels) is not None) == vnni if own else True
    if levels:
        assert model.layers[0].mlp.down_proj.a8_levels == levels
    linear = {(True, "int4"): StreamingInt4Linear, (True, "int8"): StreamingInt8Linear,
              (False, "int4"): Int4Linear, (False, "int8"): Int8Linear}[own, scheme]
    assert isinstance(model.layers[0].self_attn.qkv_proj, linear)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert isinstance(model.layers[1].mlp.gate_up_proj, linear)
    assert scheme in model.quantization and "lm_head int8" in model.quantization
    ids = list(range(3, 40))
    _, nll_ref = _teacher_forced(ref_model, ids)
    top, nll = _teacher_forced(model, ids)
    assert (nll - nll_ref).abs().max().item() < 0.05 * nll_ref.abs().max().item()


def test_quantization_config_errors():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="^quantization:"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="^quant_group_size:"):
        EngineConfig(quant_group_size=48)
