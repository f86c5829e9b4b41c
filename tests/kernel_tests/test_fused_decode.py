"""The one-call decode stack (models/fused_decode.py, kernels/csrc/decode_stack.cpp ``llama_decode_layers``) against
the Python forward it replaces: the same kernels in the same order, so the hidden states and every K/V row written
must be bit for bit equal (torch.equal), for one and several decode rows, float32 and bfloat16 caches, a QKV bias
(Qwen2), and one and two activation levels. Also: which steps it takes (a prefill row, more rows than the VNNI
limit, the torch backend, the compiled forward's meta None go to the Python forward), that ``use_vnni`` builds and
drops it, and its argument checks. Skipped where the CPU lacks AVX-512 VNNI (the fused stack needs the VNNI
panels)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import backend_cases as bc
from pagedserve.attention.base import AttentionMetadata
from pagedserve.attention.cpu import CpuAttentionBackend
from pagedserve.attention.torch_ref import TorchAttentionBackend
from pagedserve.models.cpu_linear import StreamingInt4Linear, use_int8_activations, use_vnni, vnni_available
from pagedserve.models.quant import quantize_int4

pytestmark = pytest.mark.skipif(not vnni_available(), reason="AVX-512 VNNI not available here (CPU or kernels)")

SHAPE = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)
BLOCK = 16


def int4_llama(qkv_bias: bool = False):
    """A random Llama of SHAPE whose linears are StreamingInt4Linear (group 32) on VNNI panels (up to 32 tokens)."""
    model, cfg, _ = bc.random_llama(torch.device("cpu"), **SHAPE)
    gen = torch.Generator().manual_seed(7)
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                            (layer.mlp, "down_proj")):
            w = getattr(owner, name).weight
            bias = torch.randn(w.shape[0], generator=gen) * 0.1 if qkv_bias and name == "qkv_proj" else None
            setattr(owner, name, StreamingInt4Linear(quantize_int4(w, 32), bias))
        layer.input_layernorm.data.uniform_(0.5, 1.5, generator=gen)
        layer.post_attention_layernorm.data.uniform_(0.5, 1.5, generator=gen)
    use_int8_activations(model, 16, 2)
    assert use_vnni(model, 32) == 4 * SHAPE["num_hidden_layers"]
    return model, cfg


def decode_step(model, contexts: list[int], cache_dtype=torch.float32, seed: int = 0):
    """A KV cache holding random K/V for ``contexts`` (tokens already cached per sequence) and the metadata, ids and
    positions of one decode token per sequence; returns (ids, positions, kv_caches, meta)."""
    gen = torch.Generator().manual_seed(seed)
    S = len(contexts)
    blocks_per = [-(-(n + 1) // BLOCK) for n in contexts]
    num_blocks = sum(blocks_per) + 2
    shape = (num_blocks, BLOCK, model.num_kv_heads, model.head_dim)
    kv = [(torch.randn(shape, generator=gen).to(cache_dtype), torch.randn(shape, generator=gen).to(cache_dtype))
          for _ in range(model.num_layers)]
    perm = torch.randperm(num_blocks, generator=gen)[:sum(blocks_per)].to(torch.int32)
    width = max(blocks_per)
    tables = torch.zeros(S, width, dtype=torch.int32)
    slots, start = [], 0
    for s, nb in enumerate(blocks_per):
        tables[s, :nb] = perm[start:start + nb]
        start += nb
        n = contexts[s]
        slots.append(int(tables[s, n // BLOCK]) * BLOCK + n % BLOCK)
    i32 = dict(dtype=torch.int32)
    lens = [n + 1 for n in contexts]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=tables, context_lens=torch.tensor(lens, **i32),
        query_start_loc=torch.arange(S + 1, **i32), query_lens=torch.ones(S, **i32), max_query_len=1,
        max_context_len=max(lens), num_decode_seqs=S, query_lens_cpu=[1] * S, context_lens_cpu=lens)
    ids = torch.randint(0, SHAPE["vocab_size"], (S,), generator=gen)
    return ids, torch.tensor(contexts), kv, meta


def run_both(model, ids, positions, kv, meta):
    """(fused hidden, fused caches, Python hidden, Python caches) of the same step on copies of the caches."""
    backend = CpuAttentionBackend()
    fused_kv, python_kv = copy.deepcopy(kv), copy.deepcopy(kv)
    assert model.fused_decode is not None and model.fused_decode.takes(len(ids), meta, backend, fused_kv)
    with torch.inference_mode():
        fused = model(ids, positions, fused_kv, meta, backend)
        saved, model.fused_decode = model.fused_decode, None
        try:
            python = model(ids, positions, python_kv, meta, backend)
        finally:
            model.fused_decode = saved
    return fused, fused_kv, python, python_kv


@pytest.mark.parametrize("contexts", [[5], [40, 3, 17], [100] * 9 + [1, 250]])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fused_stack_equals_the_python_forward(contexts, cache_dtype):
    model, _ = int4_llama()
    fused, fused_kv, python, python_kv = run_both(model, *decode_step(model, contexts, cache_dtype))
    assert fused.shape == (len(contexts), SHAPE["hidden_size"]) and torch.isfinite(fused).all()
    assert torch.equal(fused, python)
    for (fk, fv), (pk, pv) in zip(fused_kv, python_kv):
        assert torch.equal(fk, pk) and torch.equal(fv, pv)


@pytest.mark.parametrize("levels", [1, 2])
def test_fused_stack_with_qkv_bias_and_levels(levels):
    model, _ = int4_llama(qkv_bias=True)
    use_int8_activations(model, 16, levels)     # levels are read per call: no rebuild needed
    fused, _, python, _ = run_both(model, *decode_step(model, [30, 7], seed=3))
    assert torch.equal(fused, python)


def test_fused_stack_with_sliding_windows():
    """Per-layer sliding windows (Mistral on every layer, Qwen2 on some): the fused stack passes each layer's to the
    decode kernel, so it still equals the Python forward, and the windows change the result."""
    model, _ = int4_llama()
    step = decode_step(model, [30, 7, 100], seed=4)
    full, _, _, _ = run_both(model, *step)
    for layer, window in zip(model.layers, (20, None, 5)):
        layer.self_attn.sliding_window = window
    model.refresh_fused_decode()
    assert model.fused_decode.sliding_windows == [20, 0, 5]
    fused, fused_kv, python, python_kv = run_both(model, *step)
    assert torch.equal(fused, python) and not torch.allclose(fused, full)
    for (fk, fv), (pk, pv) in zip(fused_kv, python_kv):
        assert torch.equal(fk, pk) and torch.equal(fv, pv)


def test_which_steps_it_takes():
    model, _ = int4_llama()
    fused, cpu = model.fused_decode, CpuAttentionBackend()
    ids, positions, kv, meta = decode_step(model, [10, 20])
    assert fused.takes(2, meta, cpu, kv)
    assert not fused.takes(2, meta, TorchAttentionBackend(), kv)       # another backend
    assert not fused.takes(2, None, cpu, kv)                            # the compiled forward (meta from context)
    prefill = dataclasses.replace(meta, num_decode_seqs=1)
    assert not fused.takes(2, prefill, cpu, kv)                         # a prefill row
    assert not fused.takes(3, meta, cpu, kv)                            # rows != sequences (speculative tokens)
    _, _, kv33, meta33 = decode_step(model, [4] * 33)
    assert not fused.takes(33, meta33, cpu, kv33)                       # past vnni_max_tokens (32)
    wide = [(k.double(), v.double()) for k, v in kv]
    assert not fused.takes(2, meta, cpu, wide)                          # a cache type the kernels do not read


def test_use_vnni_builds_and_drops_it():
    model, _ = int4_llama()
    assert model.fused_decode is not None and model.fused_decode.max_tokens == 32
    use_vnni(model, 0)
    assert model.fused_decode is None
    use_vnni(model, 8)
    assert model.fused_decode.max_tokens == 8
    plain, _, _ = bc.random_llama(torch.device("cpu"), **SHAPE)        # float32 linears: nothing to fuse
    use_vnni(plain, 32)
    assert plain.fused_decode is None


def test_op_rejects_bad_arguments():
    model, _ = int4_llama()
    f = model.fused_decode
    ids, positions, kv, meta = decode_step(model, [10, 20])
    hidden = model.embed_tokens(ids)
    args = [hidden, positions, model.cos_sin_cache, f.input_norms, f.post_norms, model.norm, f.packed, f.dw, f.mw,
            f.biases, f.out_features, [2] * len(f.packed), [k for k, _ in kv], [v for _, v in kv], meta.slot_mapping,
            meta.block_tables, meta.context_lens, f.num_heads, f.num_kv_heads, f.eps, f.scale]
    ops = torch.ops.pagedserve_cpu
    with pytest.raises(RuntimeError, match="4 entries per layer"):
        ops.llama_decode_layers(*args[:6], f.packed[:-1], *args[7:])
    with pytest.raises(RuntimeError, match="one entry per layer"):
        ops.llama_decode_layers(*args[:12], args[12][:-1], *args[13:])
    with pytest.raises(RuntimeError, match="T == S"):
        ops.llama_decode_layers(*args[:15], meta.block_tables[:1], *args[16:])
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        ops.llama_decode_layers(*args[:17], 3, 2, *args[19:])
    with pytest.raises(RuntimeError, match="slot"):
        ops.llama_decode_layers(*args[:14], torch.tensor([10 ** 9, 0]), *args[15:])
